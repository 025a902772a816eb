"""Progress inside a load: ``run_point``'s and ``sweep``'s ``on_progress`` follow the simulated
clock to the run's end, in this process and from worker processes, and change no result."""

from __future__ import annotations

from trace_builders import KV_TRACES

from kvpool.cli.sweep_progress import describe
from kvpool.scenario import load_scenario
from kvpool.sim.engine import RunProgress
from kvpool.sim.run import run_point, sweep

WALL_CLOCK = ("wall_s", "cpu_s", "sim_s_per_wall_s")


def strip(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in WALL_CLOCK}


def check_reports(reports: list[RunProgress], end_s: float, window_s: float) -> None:
    """Rising simulated time from 0 to the run's end; the warm-up, then the window, then the end."""
    times = [p.now_s for p in reports]
    assert times[0] == 0.0 and times == sorted(times) and times[-1] == end_s
    assert [p.finished for p in reports] == [False] * (len(reports) - 1) + [True]
    assert reports[0].window_start_s is None and reports[0].warmup_left == reports[0].warmup_total > 0
    opened = next(k for k, p in enumerate(reports) if p.window_start_s is not None)
    assert all(p.window_start_s is None for p in reports[:opened])
    assert {p.window_start_s for p in reports[opened:]} == {reports[-1].window_start_s}
    started = [p.requests_started for p in reports]
    assert started == sorted(started) and started[0] == 0 < started[-1]  # the first report: before any entry runs
    left = [p.warmup_left for p in reports]
    assert left == sorted(left, reverse=True) and all(n == 0 for n in left[opened:])
    done = [p.window_done_s for p in reports]
    assert reports[-1].window_s == window_s and done == sorted(done)
    assert done[-1] == min(end_s - reports[-1].window_start_s, window_s)  # a run may end before its window does


def test_run_point_reports_rising_simulated_time_to_the_end_and_the_same_result():
    s = load_scenario("mi355x-1p1d", ["workload.duration_s=600"])  # ~46,000 queue entries: several reports
    reports: list[RunProgress] = []
    with_progress = run_point(s, 56, on_progress=reports.append)
    without = run_point(s, 56)
    assert strip(with_progress) == strip(without)
    assert len(reports) >= 6  # the start, one per 5,000 entries, the end
    check_reports(reports, with_progress["simulated_s"], 600.0)
    assert reports[-1].window_done_s == 600.0 and describe(reports[-1]) == (1, 1, "done")


def test_sweep_in_worker_processes_reports_each_load_before_its_result():
    s = load_scenario("mi355x-1p1d", ["workload.duration_s=300", "workload.warmup_requests=1"])
    traces = str(KV_TRACES / "trace_0001.json.gz")
    events: list[tuple] = []
    rows = sweep(s, [4, 6], traces=traces, workers=2,
                 on_progress=lambda load, p: events.append(("progress", load, p)),
                 on_done=lambda load, r: events.append(("done", load, r)))
    assert [strip(r) for r in rows] == [strip(r) for r in sweep(s, [4, 6], traces=traces, workers=1)]
    for load, row in zip((4.0, 6.0), rows):
        mine = [e for e in events if e[1] == load]
        assert mine[-1][0] == "done" and [e[0] for e in mine[:-1]] == ["progress"] * (len(mine) - 1)
        check_reports([e[2] for e in mine[:-1]], row["simulated_s"], 300.0)


def test_a_loads_bar_shows_the_warm_up_then_simulated_seconds_then_the_drain():
    warm = RunProgress(now_s=12.0, requests_started=580, warmup_left=150, warmup_total=600, window_start_s=None,
                       window_s=3600.0)
    window = RunProgress(now_s=1334.4, requests_started=2100, warmup_left=0, warmup_total=600, window_start_s=100.0,
                         window_s=3600.0)
    drain = RunProgress(now_s=3750.0, requests_started=6000, warmup_left=0, warmup_total=600, window_start_s=100.0,
                        window_s=3600.0)
    assert describe(warm) == (450, 600, "warm-up: 450/600 requests done, 580 started, 12 s")
    assert describe(window) == (1234.4, 3600.0, "simulated 1,234 of 3,600 s")
    assert describe(drain) == (3600.0, 3600.0, "finishing requests in flight")
    assert describe(RunProgress(**{**vars(drain), "finished": True})) == (1, 1, "done")
