"""The simulator's tests build their traces with the workload tests' builders
(``tests/workload/trace_builders.py``)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workload"))
