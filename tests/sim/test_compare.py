"""sim compare's outputs: ratios read as the seed states them (the first arm over the other), a CSV
beside the JSON and PNG, and a table that fits an 80-column terminal."""

import csv

from rich.console import Console

from kvpool.sim import compare


def _row(sessions: int, tput: float, gpus: int, p50: float, p90: float) -> dict:
    return {"sessions": sessions, "duration_s": 600.0, "gpus": gpus, "requests": 100, "throughput_tok_s": tput,
            "throughput_per_gpu_tok_s": tput / gpus, "ttft_p50_s": p50, "ttft_p90_s": p90, "share_gpu": 0.5,
            "share_pool": 0.4, "share_computed": 0.1, "reuse": 0.9}


ARMS = {"shared": [_row(56, 254_000.0, 32, 1.0, 2.0), _row(112, 348_000.0, 32, 1.0, 2.5)],
        "split": [_row(56, 200_000.0, 32, 2.0, 8.0), _row(112, 174_000.0, 32, 5.0, 20.0)]}


def test_ratios_are_the_first_arm_over_the_other():
    r = compare.ratios(ARMS)
    assert list(r) == ["split"]
    assert [x["sessions"] for x in r["split"]] == [56, 112]
    assert r["split"][0]["throughput_tok_s"] == 254_000 / 200_000  # the faster shared arm reads 1.27x
    assert r["split"][1]["throughput_tok_s"] == 2.0
    assert r["split"][1]["throughput_per_gpu_tok_s"] == 2.0
    assert r["split"][1]["ttft_p90_s"] == 2.5 / 20.0  # answers sooner: below 1
    # the other order gives the reciprocal: the slower arm first reads below 1, never above
    back = compare.ratios({"split": ARMS["split"], "shared": ARMS["shared"]})
    assert back["shared"][0]["throughput_tok_s"] == 200_000 / 254_000 < 1


def test_a_zero_denominator_gives_no_ratio():
    arms = {"a": [_row(56, 1.0, 8, 1.0, 1.0)], "b": [{**_row(56, 0.0, 8, 0.0, 0.0)}]}
    assert compare.ratios(arms)["b"][0] == {"sessions": 56, "throughput_tok_s": None, "throughput_per_gpu_tok_s": None,
                                           "ttft_p50_s": None, "ttft_p90_s": None}


def test_table_names_the_direction_and_fits_80_columns():
    console = Console(width=80, record=True)
    console.print(compare.ratio_table(ARMS, width=80))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "shared / split" in text and "1.27x" in text and "2.00x" in text
    assert "0.79x" not in text  # split / shared at 56 sessions: the ratio is never the wrong way round


def test_csv_has_both_throughputs_and_the_ratio(tmp_path):
    p = tmp_path / "c.csv"
    compare.write_csv(ARMS, p)
    rows = list(csv.DictReader(p.open()))
    assert [(r["arm"], r["sessions"]) for r in rows] == [("shared", "56"), ("shared", "112"), ("split", "56"), ("split", "112")]
    assert {r["reference"] for r in rows} == {"shared"}
    assert float(rows[3]["throughput_tok_s"]) == 174_000 and float(rows[3]["throughput_per_gpu_tok_s"]) == 174_000 / 32
    assert float(rows[2]["reference_over_arm_throughput_tok_s"]) == 254_000 / 200_000
    assert rows[0]["reference_over_arm_throughput_tok_s"] == ""  # the reference's own rows hold no ratio


def test_figure_is_written(tmp_path):
    compare.figure(ARMS, tmp_path / "f.png", title="shared vs split")
    assert (tmp_path / "f.png").stat().st_size > 10_000
