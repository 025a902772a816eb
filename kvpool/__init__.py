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


def __getattr__(name: str) -> str:
    """``kvpool.__version__``, read from the installed metadata when first asked for (importing
    the package stays instant: the command line's Ctrl-C guard starts after it)."""
    if name != "__version__":
        raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("kvpool")
    except PackageNotFoundError:  # running from a source tree without an install
        found = "0.0.0+unknown"
    globals()["__version__"] = found
    return found
