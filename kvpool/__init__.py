"""kvpool: plan and run a shared KV pool for agentic LLM serving.

Sub-packages (one distribution, top-level folders mapped into this namespace):
    kvpool.policy     pure decisions shared by simulator and backend (no SimPy, torch, Mooncake)
    kvpool.workload   traces, the session model, replay schedules, synthetic presets
    kvpool.sim        the SimPy simulator
    kvpool.backend    real KV paths: pools, connector, handoff, production mode
    kvpool.kernels    Triton kernels with torch references
    kvpool.scenarios  built-in scenario TOML files
    kvpool.dashboard  the Streamlit capacity planner
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvpool")
except PackageNotFoundError:  # running from a source tree without an install
    __version__ = "0.0.0+unknown"
