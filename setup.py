"""Package discovery for kvpool's flat layout, derived in one place.

Each top-level folder maps into the ``kvpool`` namespace (``sim/`` -> ``kvpool.sim``, ...), and every
folder below it holding an ``__init__.py`` is a sub-package. Deriving the list here means a new
sub-package can never be forgotten: an editable install would import it, a wheel would silently
drop it (tests/kvpool/test_wheel.py builds the wheel and imports every module from it).
"""

from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
FOLDERS = {
    "kvpool": "kvpool",
    "kvpool.policy": "policy",
    "kvpool.workload": "workload",
    "kvpool.sim": "sim",
    "kvpool.backend": "backend",
    "kvpool.kernels": "kernels",
    "kvpool.scenarios": "scenarios",
    "kvpool.dashboard": "dashboard",
}


def _packages() -> tuple[list[str], dict[str, str]]:
    packages, package_dir = [], {}
    for name, folder in FOLDERS.items():
        package_dir[name] = folder
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT / folder)
            if "__pycache__" in rel.parts:
                continue
            packages.append(".".join([name, *rel.parts]))
    return packages, package_dir


packages, package_dir = _packages()
setup(packages=packages, package_dir=package_dir)
