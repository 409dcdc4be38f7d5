"""Altair charts of the rows the other view modules build: data in, a chart out. Altair and pandas are
optional for the engine (the `app` and `notebook` extras bring them): without them, importing this module
raises `ViewsUnavailable` saying what to install."""
from __future__ import annotations

from typing import Any

from engine.views.lanes import KIND_COLORS
from engine.views.pipeline import PIPELINE_COLORS
from engine.views.requires import ViewsUnavailable, require

alt = require("altair")
pd = require("pandas")


LANE_PX = 24
"""Height of one Gantt lane: room for its label, so Vega never drops one as overlapping."""


def lanes_height(lanes: int) -> int:
    """Height of a chart of `lanes` labelled lanes (every lane keeps its label)."""
    return max(120, LANE_PX * lanes)


SVG = {"embedOptions": {"renderer": "svg"}}
"""Gantt charts draw as SVG: crisp lane labels, and text a browser test can read."""


def lane_axis(field: str) -> alt.Y:
    """The lane axis of a Gantt chart: every label drawn, none cut short."""
    return alt.Y(f"{field}:N", sort=None, title=None, axis=alt.Axis(labelOverlap=False, labelLimit=0))


def drawn_scale(colors: dict[str, str], rows: list[dict[str, Any]]) -> alt.Scale:
    """A colour scale of the kinds the rows draw, in `colors`' order: the legend lists only what is drawn."""
    kinds = [k for k in colors if k in {r["kind"] for r in rows}]
    return alt.Scale(domain=kinds, range=[colors[k] for k in kinds])


def gantt_chart(rows: list[dict[str, Any]], title: str, tooltip: list[str], *, until_ms: float | None = None) -> alt.Chart:
    """Horizontal bars over time, one row per device (or per device lane, where rows carry `row`), coloured by
    compute / communication / gradient bucket / optimizer; `until_ms` cuts the time axis there (a focus on the
    forward and backward, whose millisecond bars vanish beside a long optimizer step)."""
    y = "row" if rows and "row" in rows[0] else "device"
    x = alt.X("start_ms:Q", title="time (ms)",
              scale=alt.Scale(domain=[0, until_ms], clamp=True) if until_ms else alt.Undefined)
    return alt.Chart(pd.DataFrame(rows), title=title).mark_bar(clip=True).encode(
        x=x, x2="end_ms:Q", y=lane_axis(y),
        color=alt.Color("kind:N", scale=drawn_scale(KIND_COLORS, rows), title=None),
        tooltip=tooltip).properties(height=lanes_height(len({r[y] for r in rows})), usermeta=SVG)


def frontier_chart(rows: list[dict[str, Any]]) -> alt.VConcatChart:
    """The search frontier: best complete cost and lowest open score vs expansions, and the queue size."""
    df = pd.DataFrame(rows)
    cost = df.melt(id_vars=["expansions", "iteration"], value_vars=["best_ms", "lowest_open_ms"],
                   var_name="series", value_name="ms").dropna()
    cost["series"] = cost["series"].map({"best_ms": "best complete cost", "lowest_open_ms": "lowest open score"})
    top = alt.Chart(cost, title="Search frontier").mark_line(point=True).encode(
        x=alt.X("expansions:Q", title="states expanded"), y=alt.Y("ms:Q", title="predicted ms", scale=alt.Scale(zero=False)),
        color=alt.Color("series:N", title=None), tooltip=["expansions", "series", "ms", "iteration"]).properties(height=220)
    queue = alt.Chart(df).mark_area(opacity=0.5).encode(
        x=alt.X("expansions:Q", title="states expanded"), y=alt.Y("queue_size:Q", title="queue size"),
        tooltip=["expansions", "queue_size"]).properties(height=110)
    return alt.vconcat(top, queue)


FLAT = 1e-4
"""A series whose spread is below this share of its value is drawn from zero: a flat line, not 1e-8 ms of noise
blown up to look like oscillation."""


def value_scale(values: list[float]) -> alt.Scale:
    """A y scale zoomed on the values where they really move, from zero where they are flat."""
    top = max((abs(v) for v in values), default=0.0)
    return alt.Scale(zero=not values or max(values) - min(values) <= FLAT * top)


def history_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    return alt.Chart(pd.DataFrame(rows), title="Q<->B iterations").mark_line(point=True).encode(
        x=alt.X("step:N", sort=None, title="iteration:step"),
        y=alt.Y("predicted_ms:Q", scale=value_scale([r["predicted_ms"] for r in rows])),
        color=alt.value("#4c78a8"), tooltip=["step", "predicted_ms"]).properties(height=220)


def ratios_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    return alt.Chart(pd.DataFrame(rows), title="Sharding ratios").mark_bar().encode(
        x=alt.X("device:N", sort=None), xOffset="segment:N", y="ratio:Q", color=alt.Color("segment:N"),
        tooltip=["segment", "device", "ratio"]).properties(height=240)


def memory_chart(rows: list[dict[str, Any]]) -> alt.LayerChart:
    """Predicted peak memory per GPU (bars) against capacity (black ticks) on a log scale, so a 0.5 GiB peak
    stays visible beside a 40 GiB capacity."""
    df = pd.DataFrame(rows)
    values = [v for r in rows for v in (r["predicted_gib"], r["capacity_gib"]) if v]
    floor = min(values) / 4 if values else 1e-3
    y = alt.Y("predicted_gib:Q", title="GiB (log scale)", scale=alt.Scale(type="log", domainMin=floor))
    bars = alt.Chart(df, title="Memory per GPU vs capacity").mark_bar().encode(
        x=alt.X("device:N", sort=None), y=y, y2=alt.datum(floor),
        color=alt.condition("datum.fits", alt.value("#4c78a8"), alt.value("#e45756")),
        tooltip=["device", alt.Tooltip("predicted_gib:Q", format=".3g"), alt.Tooltip("capacity_gib:Q", format=".3g")])
    cap = alt.Chart(df).mark_tick(color="black", thickness=2, size=30).encode(x=alt.X("device:N", sort=None),
                                                                             y=alt.Y("capacity_gib:Q"))
    return (bars + cap).properties(height=240)


def histogram_chart(hist: dict[str, int]) -> alt.Chart:
    df = pd.DataFrame([{"op": k, "count": v} for k, v in hist.items()])
    return alt.Chart(df, title="Operators").mark_bar().encode(
        x=alt.X("count:Q"), y=alt.Y("op:N", sort="-x"), tooltip=["op", "count"]).properties(height=max(120, 18 * len(df)))


def compare_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    df = pd.DataFrame([r for r in rows if r["predicted_ms"] is not None])
    return alt.Chart(df, title="Predicted iteration time, same cost model").mark_bar().encode(
        x=alt.X("predicted_ms:Q", title="ms"), y=alt.Y("strategy:N", sort=None),
        color=alt.condition(alt.datum.plan, alt.value("#e45756"), alt.value("#4c78a8")),
        tooltip=["strategy", "what", "predicted_ms", "plan_speedup"]).properties(height=60 + 36 * len(df))


def replan_traffic_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    long = [{"device": r["device"], "direction": d, "bytes": r[f"{d}_bytes"]} for r in rows for d in ("sends", "receives")]
    return alt.Chart(pd.DataFrame(long)).mark_bar().encode(
        x=alt.X("device:N", sort=None), xOffset="direction:N", y="bytes:Q", color="direction:N",
        tooltip=["device", "direction", "bytes"]).properties(title="Bytes to move per device")


def pipeline_gantt_chart(rows: list[dict[str, Any]], title: str) -> alt.LayerChart:
    """One lane per stage and link direction, a box per microbatch forward/backward/transfer labelled
    with its microbatch, idle gaps of a stage drawn as bubbles."""
    df = pd.DataFrame(rows)
    base = alt.Chart(df).encode(x=alt.X("start_ms:Q", title="time (ms)"), y=lane_axis("row"))
    bars = base.mark_bar(stroke="white", strokeWidth=0.5).encode(
        x2="end_ms:Q", color=alt.Color("kind:N", title=None, scale=drawn_scale(PIPELINE_COLORS, rows)),
        tooltip=["row", "kind", "name", "microbatch", "start_ms", "end_ms"])
    labels = base.transform_calculate(mid="(datum.start_ms + datum.end_ms) / 2").mark_text(
        fontSize=9, color="white").encode(x="mid:Q", text="microbatch:N")
    return (bars + labels).properties(title=title, height=lanes_height(len({r["row"] for r in rows})), usermeta=SVG)


def pipeline_schedule_chart(rows: list[dict[str, Any]]) -> alt.Chart:
    """Predicted iteration time of the pipeline under each schedule beside the SPMD plan."""
    return alt.Chart(pd.DataFrame(rows), title="Pipeline schedules and the SPMD plan").mark_bar().encode(
        x=alt.X("predicted_ms:Q", title="ms"), y=alt.Y("strategy:N", sort=None, title=None),
        color=alt.condition(alt.datum.plan, alt.value("#e45756"), alt.value("#4c78a8")),
        tooltip=["strategy", "predicted_ms", "warmup", "fits"]).properties(height=60 + 36 * len(rows))


def _step_axis() -> alt.X:
    """Steps are whole numbers: no 0.5 ticks on a short run."""
    return alt.X("step:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1))


def _run_color(names: list[str], legend: bool = True) -> alt.Color:
    """A distinct colour per run (the default theme's shades of blue are hard to tell apart), the same
    run the same colour in every chart of the page (`names` are all the page's runs)."""
    return alt.Color("run:N", title=None, scale=alt.Scale(domain=names, scheme="tableau10"),
                     legend=alt.Legend(orient="right") if legend else None)


def loss_chart(rows: list[dict[str, Any]], names: list[str]) -> alt.LayerChart:
    """Training loss (solid) and evaluation loss (dashed, a point per evaluation) against step, a colour per run."""
    base = alt.Chart(pd.DataFrame(rows), title="Loss").encode(
        x=_step_axis(), y=alt.Y("value:Q", title="loss", scale=alt.Scale(zero=False)),
        color=_run_color(names), tooltip=["run", "series", "step", "value"])
    lines = base.mark_line().encode(strokeDash=alt.StrokeDash(
        "series:N", title=None, scale=alt.Scale(domain=["loss", "eval loss"], range=[[1, 0], [6, 3]])))
    points = base.transform_filter(alt.datum.series == "eval loss").mark_point(filled=True)
    return (lines + points).properties(height=300)


def step_series_chart(rows: list[dict[str, Any]], names: list[str], title: str, y_title: str, *,
                      legend: bool = False) -> alt.Chart:
    """One recorded figure (learning rate, grad norm, tokens/s) against step, a line per run (coloured as
    in the loss chart, whose legend names them)."""
    return alt.Chart(pd.DataFrame(rows), title=title).mark_line().encode(
        x=_step_axis(), y=alt.Y("value:Q", title=y_title, scale=alt.Scale(zero=False)),
        color=_run_color(names, legend), tooltip=["run", "step", "value"]).properties(height=220)


def step_time_chart(rows: list[dict[str, Any]], names: list[str],
                    predicted: list[dict[str, Any]]) -> alt.Chart | alt.LayerChart:
    """Measured step time per step (a line per run) beside the plan's predicted step (a dashed rule per
    run, `predicted_ms`, absent when there is nothing to compare with)."""
    measured = step_series_chart(rows, names, "Measured step time against the plan's prediction", "ms", legend=True)
    if not predicted:
        return measured
    rule = alt.Chart(pd.DataFrame(predicted)).mark_rule(strokeDash=[6, 3]).encode(
        y="predicted_ms:Q", color=_run_color(names), tooltip=["run", "predicted_ms"])
    return measured + rule


def devices_chart(rows: list[dict[str, Any]]) -> alt.HConcatChart:
    """A cluster's devices side by side: fp32 TFLOP/s of each (all its GPUs) and memory per GPU, by GPU model."""
    df = pd.DataFrame(rows)
    base = alt.Chart(df).mark_bar().encode(y=alt.Y("device:N", sort=None, title=None),
                                           color=alt.Color("gpu_model:N", title="GPU model"),
                                           tooltip=["device", "gpu_model", "machine", "gpus", "tflops", "memory_gib"])
    height = max(80, 24 * len(df))
    return alt.hconcat(base.encode(x=alt.X("tflops:Q", title="fp32 TFLOP/s")).properties(title="Compute", height=height),
                       base.encode(x=alt.X("memory_gib:Q", title="GiB per GPU")).properties(title="Memory",
                                                                                            height=height))
