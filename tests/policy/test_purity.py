"""policy/ imports nothing of SimPy, torch, Triton, Mooncake or Streamlit, and no global randomness."""

import ast
import subprocess
import sys
from pathlib import Path

POLICY = Path(__file__).resolve().parents[2] / "policy"
FORBIDDEN = {"simpy", "torch", "triton", "mooncake", "streamlit", "pydantic", "typer"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_policy_sources_import_only_stdlib_numpy_and_policy():
    files = sorted(POLICY.rglob("*.py"))
    assert files
    for f in files:
        bad = imported_roots(f) & FORBIDDEN
        assert not bad, f"{f.name} imports {bad}"


def test_importing_policy_loads_no_heavy_module():
    code = (
        "import sys, importlib, pkgutil, kvpool.policy as p\n"
        "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('kvpool.policy.' + m.name)\n"
        f"bad = sorted(m for m in {sorted(FORBIDDEN)!r} if m in sys.modules)\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_no_builtin_hash_or_global_random():
    for f in sorted(POLICY.rglob("*.py")):
        tree = ast.parse(f.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "hash", f"{f.name} calls built-in hash()"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                v = node.func.value
                if isinstance(v, ast.Name) and v.id == "random":
                    assert node.func.attr == "Random", f"{f.name} uses global random.{node.func.attr}"
