"""Altair chart builders for the dashboard, shaped like the seed's figures (no Streamlit here).

Each builder takes a frame from ``kvpool.dashboard.results`` and returns an ``alt.Chart``:
    * per load (x: sessions or RPS): ``throughput``, ``token_sources`` (stacked GPU / pool /
      computed shares), ``ttft`` (p50 and p90), ``decode_occupancy_p50``;
    * over simulated time: ``pool_occupancy``, ``evictions``, ``decode_occupancy``;
    * distributions: ``restore_latency`` (empirical CDF of the per-stage restore time);
    * across scenarios: ``compare_metric`` (grouped bars), ``ratios``;
    * capacity search: ``plan_metric`` (one target's metric over the explored values, the target as a rule).
"""

from __future__ import annotations

import altair as alt
import pandas as pd

HEIGHT = 260
SOURCE_COLORS = {"GPU prefix cache": "#55a868", "KV pool (Store)": "#dd8452", "SSD tier": "#937860",
                 "computed": "#c44e52"}


_LEGEND = alt.Legend(orient="right", title=None)


def _loads(frame: pd.DataFrame) -> list[str]:
    """The load labels in the order the frame lists them (load order), not alphabetically."""
    return list(dict.fromkeys(frame["load"]))


def _x(key: str) -> alt.X:
    return alt.X(f"{key}:O", title=key, axis=alt.Axis(labelAngle=0))


def throughput(summary: pd.DataFrame, key: str) -> alt.Chart:
    """Throughput per GPU (tok/s) per load, as bars."""
    return (
        alt.Chart(summary, title="Throughput per GPU")
        .mark_bar(color="#4c72b0")
        .encode(_x(key), alt.Y("throughput_per_gpu_tok_s:Q", title="tok/s per GPU"),
                tooltip=[key, alt.Tooltip("throughput_per_gpu_tok_s:Q", format=",.0f")])
        .properties(height=HEIGHT)
    )


def token_sources(summary: pd.DataFrame, key: str) -> alt.Chart:
    """Where prompt tokens came from, stacked shares per load: GPU cache, pool (and its SSD part), computed."""
    f = summary[[key]].copy()
    f["GPU prefix cache"] = summary["share_gpu"]
    ssd = summary["share_ssd"] if "share_ssd" in summary else pd.Series(0.0, index=summary.index)
    f["KV pool (Store)"] = summary["share_pool"] - ssd.fillna(0.0)  # share_ssd is the SSD part of share_pool
    if (ssd.fillna(0.0) > 0).any():
        f["SSD tier"] = ssd
    f["computed"] = summary["share_computed"]
    long = f.melt(id_vars=[key], var_name="source", value_name="share")
    order = [c for c in SOURCE_COLORS if c in f.columns]
    long["order"] = long["source"].map(order.index)
    return (
        alt.Chart(long, title="Token sources (share of prompt tokens)")
        .mark_bar()
        .encode(
            _x(key),
            alt.Y("share:Q", title="share", axis=alt.Axis(format="%"), scale=alt.Scale(domain=[0, 1])),
            alt.Color("source:N", scale=alt.Scale(domain=order, range=[SOURCE_COLORS[c] for c in order]),
                      legend=_LEGEND),
            alt.Order("order:Q"),
            tooltip=[key, "source", alt.Tooltip("share:Q", format=".1%")],
        )
        .properties(height=HEIGHT)
    )


def ttft(summary: pd.DataFrame, key: str) -> alt.Chart:
    """Time to first token, p50 and p90 per load."""
    long = summary[[key, "ttft_p50_s", "ttft_p90_s"]].rename(columns={"ttft_p50_s": "p50", "ttft_p90_s": "p90"})
    long = long.melt(id_vars=[key], var_name="percentile", value_name="ttft_s")
    return (
        alt.Chart(long, title="Time to first token")
        .mark_line(point=True)
        .encode(_x(key), alt.Y("ttft_s:Q", title="TTFT (s)"),
                alt.Color("percentile:N", legend=_LEGEND),
                alt.StrokeDash("percentile:N", legend=None),
                tooltip=[key, "percentile", alt.Tooltip("ttft_s:Q", format=".2f")])
        .properties(height=HEIGHT)
    )


def decode_occupancy_p50(summary: pd.DataFrame, key: str) -> alt.Chart:
    """Time-weighted median decode KV occupancy per load."""
    return (
        alt.Chart(summary, title="Decode KV occupancy (p50)")
        .mark_bar(color="#8172b3")
        .encode(_x(key), alt.Y("decode_kv_occupancy_p50:Q", title="of decode KV capacity",
                               axis=alt.Axis(format="%"), scale=alt.Scale(domain=[0, 1])),
                tooltip=[key, alt.Tooltip("decode_kv_occupancy_p50:Q", format=".1%")])
        .properties(height=HEIGHT)
    )


def _over_time(frame: pd.DataFrame, y: str, title: str, y_title: str, fmt: str | None = None) -> alt.Chart:
    axis = alt.Axis(format=fmt) if fmt else alt.Axis()
    return (
        alt.Chart(frame, title=title)
        .mark_line()
        .encode(alt.X("t_s:Q", title="simulated time (s)"), alt.Y(f"{y}:Q", title=y_title, axis=axis),
                alt.Color("load:N", legend=_LEGEND, sort=_loads(frame)),
                tooltip=["load", alt.Tooltip("t_s:Q", format=".0f"), alt.Tooltip(f"{y}:Q", format=fmt or ",")])
        .properties(height=HEIGHT)
    )


def pool_occupancy(timeline: pd.DataFrame) -> alt.Chart:
    """Pool bytes used over capacity, over simulated time, per load."""
    return _over_time(timeline, "pool_used", "Pool occupancy", "of pool capacity", ".0%")


def evictions(timeline: pd.DataFrame) -> alt.Chart:
    """Cumulative evicted chunk groups over simulated time, per load."""
    return _over_time(timeline, "evicted_groups", "Pool evictions (cumulative groups)", "evicted groups")


def decode_occupancy(frame: pd.DataFrame) -> alt.Chart:
    """Reserved decode KV over decode KV capacity, over simulated time."""
    return _over_time(frame, "decode_kv_occupancy", "Decode KV occupancy over time", "of decode KV capacity", ".0%")


def restore_latency(restore: pd.DataFrame) -> alt.Chart:
    """Empirical CDF of the per-stage restore time (pool read + unpack), per load."""
    f = restore.sort_values(["load", "restore_stage_s"]).copy()
    f["fraction"] = f.groupby("load").cumcount().add(1) / f.groupby("load")["restore_stage_s"].transform("size")
    return (
        alt.Chart(f, title="Restore latency per stage (CDF)")
        .mark_line(interpolate="step-after")
        .encode(alt.X("restore_stage_s:Q", title="restore time per stage (s)"),
                alt.Y("fraction:Q", title="fraction of restores", axis=alt.Axis(format="%")),
                alt.Color("load:N", legend=_LEGEND, sort=_loads(restore)),
                tooltip=["load", alt.Tooltip("restore_stage_s:Q", format=".3f"), alt.Tooltip("fraction:Q", format=".0%")])
        .properties(height=HEIGHT)
    )


def compare_metric(frame: pd.DataFrame, key: str, metric: str, title: str, fmt: str = ",.3g") -> alt.Chart:
    """One metric per load, bars grouped by scenario."""
    return (
        alt.Chart(frame, title=title)
        .mark_bar()
        .encode(_x(key), alt.Y(f"{metric}:Q", title=title),
                alt.XOffset("scenario:N", sort=list(dict.fromkeys(frame["scenario"]))),
                alt.Color("scenario:N", legend=_LEGEND, sort=list(dict.fromkeys(frame["scenario"]))),
                tooltip=["scenario", key, alt.Tooltip(f"{metric}:Q", format=fmt)])
        .properties(height=HEIGHT)
    )


def ratios(ratio: pd.DataFrame, key: str) -> alt.Chart:
    """Each ratio metric (rows) per compared pair and load (bars): the first scenario's value over
    the other's (``results.ratio_frame``); the dashed rule is 1, equal values."""
    long = ratio.melt(id_vars=["ratio", key], var_name="metric", value_name="value")
    long["pair"] = long["ratio"] + " @ " + long[key].map(lambda v: f"{v:g}") + f" {key}"
    metrics = list(dict.fromkeys(long["metric"]))
    pairs = list(dict.fromkeys(long["pair"]))
    bars = alt.Chart(long).mark_bar().encode(
        alt.Y("metric:N", title=None, sort=metrics, axis=alt.Axis(labelLimit=260)),
        alt.X("value:Q", title="first over other (1 = equal)"),
        alt.YOffset("pair:N", sort=pairs),
        alt.Color("pair:N", sort=pairs, legend=alt.Legend(orient="top", title=None, columns=1, labelLimit=400)),
        tooltip=["ratio", key, "metric", alt.Tooltip("value:Q", format=".3f")],
    )
    rule = alt.Chart(pd.DataFrame({"x": [1.0]})).mark_rule(color="black", strokeDash=[4, 4]).encode(x="x:Q")
    return (bars + rule).properties(title="The reference over each other scenario",
                                    height=max(HEIGHT, 22 * len(metrics) * len(pairs) + 60))


MEETS_COLORS = {"meets": "#55a868", "fails": "#c44e52"}


def plan_metric(curve: pd.DataFrame, field: str, metric: str, op: str, target: float,
                best: float | None = None) -> alt.Chart:
    """One target's metric (y) over the explored values of the variable (x): the runs as points
    coloured by whether they meet every target, the target as a dashed rule, the best value as a
    vertical rule. ``curve`` is ``results.plan_frame`` (columns ``value``, ``meets_targets``, metrics)."""
    f = curve[["value", "meets_targets", metric]].sort_values("value").copy()
    f["verdict"] = f["meets_targets"].map({True: "meets", False: "fails"})
    x = alt.X("value:Q", title=field)
    y = alt.Y(f"{metric}:Q", title=metric)
    line = alt.Chart(f).mark_line(color="#8c8c8c").encode(x, y)
    points = alt.Chart(f).mark_point(filled=True, size=80).encode(
        x, y,
        alt.Color("verdict:N", title="all targets", scale=alt.Scale(domain=list(MEETS_COLORS),
                                                                     range=list(MEETS_COLORS.values())),
                  legend=alt.Legend(orient="right")),
        tooltip=[alt.Tooltip("value:Q", title=field, format=",.4g"), alt.Tooltip(f"{metric}:Q", format=",.4g"),
                 alt.Tooltip("verdict:N", title="all targets")],
    )
    rule = alt.Chart(pd.DataFrame({"target": [target]})).mark_rule(color="black", strokeDash=[4, 4]).encode(
        alt.Y("target:Q"), tooltip=[alt.Tooltip("target:Q", title=f"target {metric}{op}")])
    layers = [line, points, rule]
    if best is not None:
        layers.append(alt.Chart(pd.DataFrame({"best": [best]})).mark_rule(color="#4c72b0").encode(
            alt.X("best:Q"), tooltip=[alt.Tooltip("best:Q", title=f"best {field}", format=",.4g")]))
    return alt.layer(*layers).properties(title=f"{metric} {op} {target:g}", height=HEIGHT)
