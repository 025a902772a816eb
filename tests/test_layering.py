"""The import arrows of ``design.md``'s layout table hold: every module's imports (read from its
source with ``ast``, the ones inside functions and ``TYPE_CHECKING`` blocks included) point only
down the "may import" column.

    policy            stdlib, numpy and policy only
    workload          no sim (outside the workload layer), backend, kernels, dashboard, scenario, CLI
    kvpool.scenario   no sim, backend, kernels, dashboard, CLI
    sim               no backend, kernels, dashboard, CLI
    kernels           no sim, backend, dashboard, scenario, workload, CLI
    backend           no sim, dashboard, CLI
    dashboard         no backend, kernels, CLI

A break that is being fixed may stand in ``KNOWN_BREAKS`` with its reason; an entry that no longer
matches a real import fails the test too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: source folder -> the package it is installed as (pyproject.toml / setup.py)
PACKAGES = {"kvpool": "kvpool", "policy": "kvpool.policy", "workload": "kvpool.workload", "sim": "kvpool.sim",
            "backend": "kvpool.backend", "kernels": "kvpool.kernels", "dashboard": "kvpool.dashboard"}

SIM, BACKEND, KERNELS, DASHBOARD = "kvpool.sim", "kvpool.backend", "kvpool.kernels", "kvpool.dashboard"
CLI, SCENARIO = "kvpool.cli", "kvpool.scenario"
WORKLOADS = ("kvpool.workload",)  # the workload layer


@dataclass(frozen=True)
class Rule:
    packages: tuple[str, ...]  # the modules the rule is about (these packages and below)
    forbidden: tuple[str, ...]  # they import nothing of these ...
    except_: tuple[str, ...] = ()  # ... except of these


RULES = [
    Rule(WORKLOADS, (SIM, BACKEND, KERNELS, DASHBOARD, SCENARIO, CLI), except_=WORKLOADS),
    Rule((SCENARIO,), (SIM, BACKEND, KERNELS, DASHBOARD, CLI)),
    Rule((SIM,), (BACKEND, KERNELS, DASHBOARD, CLI)),
    Rule((KERNELS,), (SIM, BACKEND, DASHBOARD, SCENARIO, CLI, *WORKLOADS)),
    Rule((BACKEND,), (SIM, DASHBOARD, CLI), except_=WORKLOADS),
    Rule((DASHBOARD,), (BACKEND, KERNELS, CLI)),
]

#: (importing module, imported module) -> why it still stands
KNOWN_BREAKS: dict[tuple[str, str], str] = {}


def _under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def modules() -> dict[str, Path]:
    """Every source module by its installed name."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def imported(module: str, path: Path) -> set[str]:
    """The modules ``module`` imports anywhere in its source; ``from X import a`` gives ``X`` and
    ``X.a`` (``a`` may be a submodule). Relative imports are resolved."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names if a.name != "*"}
    return names


def breaks() -> set[tuple[str, str]]:
    found = set()
    for module, path in modules().items():
        for name in imported(module, path):
            if _under(module, ("kvpool.policy",)):
                top = name.split(".")[0]
                if not (top in sys.stdlib_module_names or top == "numpy" or _under(name, ("kvpool.policy",))):
                    found.add((module, name))
            for rule in RULES:
                if (_under(module, rule.packages) and _under(name, rule.forbidden)
                        and not _under(name, rule.except_)):
                    found.add((module, name))
    # ``from X import a`` reports X.a where X itself breaks the rule: keep the module, not each name
    return {(m, n) for m, n in found if (m, n.rsplit(".", 1)[0]) not in found}


def test_every_import_points_down_the_layers():
    found = breaks()
    new = sorted(found - set(KNOWN_BREAKS))
    assert not new, "imports against design.md's layering:\n" + "\n".join(f"{m} imports {n}" for m, n in new)
    stale = sorted(set(KNOWN_BREAKS) - found)
    assert not stale, f"KNOWN_BREAKS entries that no longer occur (remove them): {stale}"


def test_the_import_reader_sees_every_kind_of_import(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("import a.b\nfrom c import d\nfrom . import e\nfrom ..f import g\n"
                   "def late():\n    from kvpool import cli\n")
    got = imported("kvpool.sim.x.mod", src)
    assert {"a.b", "c", "c.d", "kvpool.sim.x", "kvpool.sim.x.e", "kvpool.sim.f", "kvpool.sim.f.g",
            "kvpool", "kvpool.cli"} <= got
    assert modules()["kvpool.policy.hits"] == ROOT / "policy" / "hits.py"
