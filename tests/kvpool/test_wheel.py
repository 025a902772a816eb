"""The built wheel, installed into a fresh venv, imports every module and runs ``kvpool --help``.

An editable install imports a sub-package that the package list forgot; a wheel silently drops it.
This test builds the wheel from the source tree, installs it (without dependencies) into a new
venv that borrows this environment's dependencies through a path entry, and imports every module
from the wheel's copy.
"""

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ["kvpool", "policy", "workload", "sim", "backend", "kernels", "scenarios", "dashboard"]
# Streamlit page scripts run UI code at import; they are checked by the dashboard's own tests.
SCRIPT_DIRS = {"pages"}


def source_modules() -> list[str]:
    mods = []
    for folder in FOLDERS:
        base = "kvpool" if folder == "kvpool" else f"kvpool.{folder}"
        for py in sorted((ROOT / folder).rglob("*.py")):
            rel = py.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts or SCRIPT_DIRS & set(rel.parts[:-1]):
                continue
            parts = list(rel.parts[:-1]) + ([] if rel.name == "__init__.py" else [rel.stem])
            mods.append(".".join([base, *parts]))
    return mods


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True)
    (whl,) = out.glob("kvpool-*.whl")
    return whl


def test_wheel_contains_every_module_scenario_and_preset(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for mod in source_modules():
        path = mod.replace(".", "/")
        assert f"{path}.py" in names or f"{path}/__init__.py" in names, mod
    assert "kvpool/scenarios/mi355x-1p1d.toml" in names
    presets = sorted(p.name for p in (ROOT / "workload" / "presets").glob("*.json"))
    assert presets and all(f"kvpool/workload/presets/{p}" in names for p in presets), presets
    assert {"kvpool/backend/serve/tokenizer/tokenizer.json", "kvpool/backend/serve/tokenizer/tokenizer_config.json"} <= names


def test_fresh_venv_imports_everything_from_the_wheel(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # Dependencies come from this environment's site-packages (a plain path entry: the editable
    # kvpool's finder there is never activated, so kvpool itself resolves to the wheel's copy).
    site = Path(subprocess.check_output([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                        text=True).strip())
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    mods = source_modules()
    code = (
        "import importlib, kvpool, sys\n"
        f"assert kvpool.__file__.startswith({str(site)!r}), kvpool.__file__\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        "from kvpool.scenario import load_scenario\n"
        "print(load_scenario('mi355x-1p1d').name)\n"
        "from kvpool.workload.presets import PRESETS\n"
        "from kvpool.workload.synth import preset_params\n"
        "print(','.join(preset_params(name).name for name in PRESETS))\n"
    )
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["mi355x-1p1d", "agentx-062126,kv-cache-tester"]
    h = subprocess.run([venv / "bin" / "kvpool", "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert h.returncode == 0 and "scenario" in h.stdout
