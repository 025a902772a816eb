"""Chart builders and result frames on hand-made results (no simulation, no Streamlit)."""

from __future__ import annotations

from kvpool.dashboard import charts, results


def _row(load: int, ssd: float = 0.0) -> dict:
    return {
        "scenario": "x", "sessions": load, "duration_s": 60.0, "requests": 10, "throughput_tok_s": 8000.0 * load, "throughput_per_gpu_tok_s": 1000.0 * load,
        "ttft_p50_s": 1.0, "ttft_p90_s": 2.0, "share_gpu": 0.5, "share_pool": 0.3, "share_ssd": ssd,
        "share_computed": 0.2, "reuse": 0.8, "gen_speed_per_user_tok_s_p50": 50.0, "decode_kv_occupancy_p50": 0.4,
        "timeline": {"pool_t": [0.0, 10.0], "pool_used": [0.0, 0.5], "pool_evicted": [0, 3],
                     "decode_t": [0.0, 5.0, 10.0], "decode_occ": [0.0, 0.3, 0.6]},
        "restore_stage_s": [0.01, 0.02, 0.05],
    }


def _data(chart) -> list[dict]:
    spec = chart.to_dict()
    return next(iter(spec["datasets"].values())) if "datasets" in spec else spec["data"]["values"]


def test_token_sources_stack_to_one_and_split_out_the_ssd_part():
    summary = results.summary_frame([_row(8, ssd=0.1), _row(16)])
    data = _data(charts.token_sources(summary, "sessions"))
    for load in (8, 16):
        shares = {d["source"]: d["share"] for d in data if d["sessions"] == load}
        assert abs(sum(shares.values()) - 1.0) < 1e-12
    assert {d["source"]: d["share"] for d in data if d["sessions"] == 8}["SSD tier"] == 0.1


def test_every_builder_makes_a_valid_spec():
    rows = [_row(8), _row(16)]
    summary = results.summary_frame(rows)
    timeline = results.timeline_frame(rows)
    built = [
        charts.throughput(summary, "sessions"), charts.ttft(summary, "sessions"),
        charts.decode_occupancy_p50(summary, "sessions"), charts.pool_occupancy(timeline), charts.evictions(timeline),
        charts.restore_latency(results.restore_frame(rows)),
        charts.decode_occupancy(results.decode_frame(rows)),
    ]
    runs = {"a": rows, "b": [_row(8), _row(16)]}
    built += [charts.compare_metric(results.compare_frame(runs), "sessions", "reuse", "reuse"),
              charts.ratios(results.ratio_frame(runs), "sessions")]
    for chart in built:
        assert chart.to_dict()["$schema"].startswith("https://vega.github.io/schema/vega-lite/")


def test_ratios_read_the_first_scenario_over_each_other_as_the_cli_does():
    fast = _row(8)
    fast["throughput_per_gpu_tok_s"] *= 2
    fast["ttft_p90_s"] = 4.0
    slow = _row(8)
    slow["ttft_p90_s"] = 8.0
    ratio = results.ratio_frame({"fast": [fast], "slow": [slow]})
    rec = ratio.to_dict("records")[0]
    assert list(ratio["ratio"]) == ["fast / slow"] and rec["sessions"] == 8
    assert rec["throughput per GPU"] == 2.0  # the faster reference reads above 1, as kvpool sim compare prints it
    assert rec["TTFT p90"] == 0.5
    from kvpool.sim.compare import ratios

    cli = ratios({"fast": [fast], "slow": [slow]})["slow"][0]
    assert rec["system throughput"] == cli["throughput_tok_s"] and rec["TTFT p90"] == cli["ttft_p90_s"]


def test_decode_frame_reads_the_exported_series_per_load():
    old = _row(32)
    del old["timeline"]["decode_t"]  # a result without the series (older simulator) is left out, not an error
    frame = results.decode_frame([_row(8), _row(16), old])
    assert list(dict.fromkeys(frame["load"])) == ["8 sessions", "16 sessions"]
    assert list(frame[frame["load"] == "8 sessions"]["decode_kv_occupancy"]) == [0.0, 0.3, 0.6]
    assert results.decode_frame([old]).empty
