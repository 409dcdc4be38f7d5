"""Plans, clusters, graphs, searches and comparisons that draw themselves in Jupyter.

`import engine.notebook` (or `%load_ext engine.notebook`) registers an IPython display formatter for
`Graph`, `Cluster`, both plan kinds, a search's `SearchResult`, a baseline `Comparison` and a `WhatIf`: each
shows a short HTML summary (the Plan page's headline figures) and its main chart, drawn by `engine.views`
(the same functions as the Streamlit pages). A chart is emitted as Vega-Lite, which JupyterLab and VS Code
render natively, with an SVG fallback made offline by vl-convert, so it also shows in nbconvert HTML and on a
repository's web view. The classes carry no chart code: `plan.show("timeline")` reaches `show` below through
the drawer this module installs (`engine.display`). `repr()` stays one line for logs.

A plan records its cluster's fingerprint, not the cluster: the views that need the cluster (the timeline,
memory against capacity) take `cluster=`, or else use the notebook's variable holding that very cluster.
"""
from __future__ import annotations

import html
import inspect
from dataclasses import asdict, dataclass
from typing import Any, Callable

import engine.display
from engine import views
from engine.cluster.spec import Cluster
from engine.compare import Comparison, WhatIf, what_if
from engine.errors import HapError
from engine.model.graph import Graph
from engine.pipeline.plan import PipelinePlan
from engine.spmd.plan import Plan
from engine.spmd.synthesis import SearchResult
from engine.views import charts
from engine.views.requires import require

alt = require("altair")
pd = require("pandas")
vl_convert = require("vl_convert")

VEGA_LITE_VERSION = ".".join(alt.SCHEMA_VERSION.lstrip("v").split(".")[:2])
"""The Vega-Lite version of the installed Altair's specs ("5.20" for Altair 5.5), which vl-convert renders with."""
VEGA_LITE = f"application/vnd.vegalite.v{VEGA_LITE_VERSION.split('.')[0]}+json"
"""Their MIME type (v5 for Altair 5: what JupyterLab 4 renders natively)."""


class ViewError(HapError, ValueError):
    """A view that does not exist for the object, or that needs what was not given (e.g. the cluster)."""


# ----------------------------------------------------------------------------- what a display holds


@dataclass(frozen=True)
class Figure:
    """One chart as a notebook shows it: Vega-Lite for live front ends, SVG for everything else."""

    chart: Any
    name: str

    def spec(self) -> dict[str, Any]:
        """The Vega-Lite spec, data inlined (Altair's row limit applies: Gantts are coarsened below it)."""
        return self.chart.to_dict()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> dict[str, Any]:
        spec = self.spec()
        return {VEGA_LITE: spec, "image/svg+xml": vl_convert.vegalite_to_svg(spec, vl_version=VEGA_LITE_VERSION), "text/plain": f"<{self.name}>"}


@dataclass(frozen=True)
class Summary:
    """An object's headline figures as a small HTML table, each figure's explanation as its tooltip."""

    title: str
    figures: list[tuple[str, str, str]]
    note: str = ""

    def _repr_html_(self) -> str:
        cells = "".join(f'<tr title="{html.escape(why)}"><td>{html.escape(label)}</td><td><b>{html.escape(value)}</b>'
                        f"</td></tr>" for label, value, why in self.figures)
        note = f"<div><i>{html.escape(self.note)}</i></div>" if self.note else ""
        return f'<div class="hap-summary"><b>{html.escape(self.title)}</b><table>{cells}</table>{note}</div>'

    def __repr__(self) -> str:
        lines = [self.title] + [f"  {label}: {value}" for label, value, _ in self.figures]
        return "\n".join(lines + ([self.note] if self.note else []))


@dataclass(frozen=True)
class Card:
    """What an object displays: its summary, then its main chart (None: it has none)."""

    summary: Summary
    figure: Figure | None


# ----------------------------------------------------------------------------- the views of each kind


def find_cluster(plan: Plan | PipelinePlan, cluster: Cluster | None = None) -> Cluster | None:
    """`cluster` when given, else a variable of the running notebook holding the cluster the plan was made for
    (the same fingerprint), else None."""
    if cluster is not None:
        return cluster
    ip = _ipython()
    namespace = ip.user_ns.values() if ip is not None else ()
    return next((v for v in namespace if isinstance(v, Cluster) and v.fingerprint() == plan.cluster_fingerprint), None)


def _needs_cluster(plan: Plan, cluster: Cluster | None, view: str) -> Cluster:
    found = find_cluster(plan, cluster)
    if found is None:
        raise ViewError(f"the {view} view needs the cluster the plan was made for ('{plan.cluster_name}'): "
                        f"plan.show({view!r}, cluster=cluster)")
    return found


def timeline(plan: Plan, cluster: Cluster | None = None, *, group: bool = False) -> Figure:
    """The predicted iteration, a compute and a network lane per device (a long one coarsened to fit a chart)."""
    rows = views.plan_lane_rows(plan, _needs_cluster(plan, cluster, "timeline"), group=group)
    return gantt_figure(rows, f"Predicted: {views.ms(plan.predicted_time_s)} per iteration")


def gantt_figure(rows: list[dict[str, Any]], title: str) -> Figure:
    """Lane rows as a Gantt, coarsened to the bars a chart carries (`engine.views.coarsen`): a 48-layer plan's
    iteration has more tasks than Altair embeds."""
    tooltip = ["device", "lane", "kind", "name", "start_ms", "end_ms"]
    return Figure(charts.gantt_chart(views.coarsen(rows), title, tooltip), "timeline")


def memory(plan: Plan, cluster: Cluster | None = None) -> Figure:
    """Predicted peak memory per GPU against each device's capacity."""
    return Figure(charts.memory_chart(views.memory_rows(plan, _needs_cluster(plan, cluster, "memory"))), "memory")


def ratios(plan: Plan) -> Figure:
    """The sharding ratio of every device in every segment."""
    return Figure(charts.ratios_chart(views.ratio_rows(plan)), "ratios")


def frontier(plan: Plan) -> Figure:
    """The search frontier the plan's search recorded (best complete cost, lowest open score, queue size)."""
    points = plan.search.get("frontier") or []
    if not points:
        raise ViewError("the plan's search recorded no frontier (a baseline, or a plan read from an old file)")
    return Figure(charts.frontier_chart(views.frontier_rows(points)), "frontier")


def history(plan: Plan) -> Figure:
    """Predicted time after each synthesis (Q) and balancing (B) step of the planner's loop."""
    if not plan.history:
        raise ViewError("the plan records no Q<->B history (a baseline, or a plan read from an old file)")
    return Figure(charts.history_chart(views.history_rows(plan)), "history")


def pipeline_timeline(plan: PipelinePlan, schedule: str | None = None) -> Figure:
    """The simulated pipeline iteration under `schedule` (default: the plan's), a lane per stage and link."""
    rows = views.coarsen(views.pipeline_gantt_rows(plan, schedule))
    span = max((r["end_ms"] for r in rows), default=0.0)
    title = f"Predicted, {schedule or plan.schedule}: {span:.4g} ms per iteration"
    return Figure(charts.pipeline_gantt_chart(rows, title), "pipeline timeline")


def schedules(plan: PipelinePlan) -> Figure:
    """The pipeline's predicted time under every schedule, beside the best SPMD plan when planned."""
    return Figure(charts.pipeline_schedule_chart(views.pipeline_schedule_rows(plan)), "schedules")


VIEWS: dict[type, dict[str, Callable[..., Figure]]] = {
    Plan: {"timeline": timeline, "memory": memory, "ratios": ratios, "frontier": frontier, "history": history},
    PipelinePlan: {"timeline": pipeline_timeline, "schedules": schedules},
}
"""The views `show` draws for each kind, the first of each its main one; each view's function names its options."""


def show(obj: Plan | PipelinePlan, view: str | None = None, **options: Any) -> Figure:
    """One view of a plan (None: its main one) as a displayable `Figure`; `plan.show(...)` calls this."""
    kinds = VIEWS.get(type(obj))
    if kinds is None:
        raise ViewError(f"show draws plans (Plan, PipelinePlan), not {type(obj).__name__}")
    name = view or next(iter(kinds))
    if name not in kinds:
        raise ViewError(f"no view {name!r} of a {type(obj).__name__}: choose one of {', '.join(kinds)}")
    draw = kinds[name]
    if "cluster" not in inspect.signature(draw).parameters:
        options.pop("cluster", None)  # one call for every view: plan.show(view, cluster=c) whether it needs it or not
    return draw(obj, **options)


def theory(graph: Graph, tensor: str | None = None) -> Any:
    """The Hoare triples of the background theory for one tensor (by node name; all when None) as a table."""
    rows = [r for r in views.theory_rows(graph) if tensor is None or r["tensor"] == tensor]
    if not rows:
        names = ", ".join(n.name for n in graph.nodes[:8])
        raise ViewError(f"no tensor named {tensor!r} in {graph.name}: its nodes are named like {names}, ...")
    return pd.DataFrame(rows, columns=["tensor", "op", "kind", "rule", "triple"])


# ----------------------------------------------------------------------------- the card of each type


def graph_card(graph: Graph) -> Card:
    s = views.model_summary(graph)
    figures = [("Parameters", f"{s['parameters']:,}", "trainable elements"),
               ("FLOPs per iteration", f"{s['iteration_flops']:.3g}", f"forward {s['forward_flops']:.3g}, backward ~2x"),
               ("Nodes", str(s["nodes"]), "operators, parameters and inputs of the captured graph"),
               ("Segments", str(s["segments"]), "layers: runs of nodes that may get their own sharding ratios")]
    return Card(Summary(f"Model {graph.name}", figures), Figure(charts.histogram_chart(graph.op_histogram()), "operators"))


def cluster_card(cluster: Cluster) -> Card:
    return Card(Summary(f"Cluster {cluster.name}", views.cluster_figures(cluster), cluster.description),
                Figure(charts.devices_chart(views.capacity_rows(cluster)), "devices"))


def plan_card(plan: Plan) -> Card:
    cluster = find_cluster(plan)
    note = "" if cluster is not None else (f"The timeline needs cluster '{plan.cluster_name}': "
                                           "plan.show('timeline', cluster=cluster); the ratios are shown instead.")
    figure = timeline(plan, cluster) if cluster is not None else ratios(plan)
    title = f"SPMD plan of {plan.graph.name} on {plan.cluster_name}"
    return Card(Summary(title, views.plan_figures(plan, cluster), note), figure)


def pipeline_card(plan: PipelinePlan) -> Card:
    name = plan.graph.name if plan.graph is not None else "?"
    return Card(Summary(f"Pipeline plan of {name} on {plan.cluster_name}", views.pipeline_figures(plan)),
                pipeline_timeline(plan))


def search_card(result: SearchResult) -> Card:
    figures = [("Best program", views.ms(result.cost), "its predicted iteration at the search's ratios"),
               ("Optimal", "yes" if result.optimal else "no", "no: the budget or the beam stopped the search first"),
               ("States expanded", f"{result.expanded:,}", f"{result.generated:,} generated, {result.pruned:,} pruned"),
               ("Search time", f"{result.elapsed_s:.3g} s", "")]
    points = [asdict(p) for p in result.frontier]
    figure = Figure(charts.frontier_chart(views.frontier_rows(points)), "frontier") if points else None
    return Card(Summary("Program search (A*)", figures), figure)


def comparison_card(result: Comparison) -> Card:
    figures = [("Plan", views.ms(result.plan_time_s), "predicted iteration")]
    best = result.best_baseline
    if best is not None:
        figures.append((f"vs best baseline ({best.name})", f"{result.speedup(best):.2f}x faster",
                        f"{best.name}: {views.ms(best.predicted_time_s)}, priced as a PyTorch DDP run"))
    if result.compute_bound_s is not None:
        figures.append(("Compute bound", views.ms(result.compute_bound_s), "the model's FLOPs at the summed peak"))
    return Card(Summary("The plan against the baselines and ablations", figures),
                Figure(charts.compare_chart(result.table()), "comparison"))


def what_if_card(w: WhatIf) -> Card:
    figures = [("Plan, original cluster", views.ms(w.before_s), ""),
               ("Same plan, changed cluster", views.ms(w.same_plan_s), f"{(w.same_plan_s - w.before_s) * 1e3:+.4g} ms"),
               ("Re-planned, changed cluster", views.ms(w.replanned_s),
                f"{(w.replanned_s - w.same_plan_s) * 1e3:+.4g} ms against the same plan")]
    return Card(Summary(f"What if: {', '.join(w.changes) or 'no change'}", figures), timeline(w.replanned, w.cluster))


CARDS: dict[type, Callable[[Any], Card]] = {Graph: graph_card, Cluster: cluster_card, Plan: plan_card,
                                            PipelinePlan: pipeline_card, SearchResult: search_card,
                                            Comparison: comparison_card, WhatIf: what_if_card}
"""The display of each type the formatter is registered for."""


# ----------------------------------------------------------------------------- IPython


def _ipython() -> Any:
    """The running IPython shell, or None (a plain Python process)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def display_card(obj: Any) -> None:
    """Display `obj`'s card as two outputs: the summary (HTML), then the chart (Vega-Lite + SVG), so a front end
    that prefers Vega-Lite still shows the summary."""
    from IPython.display import display

    card = CARDS[type(obj)](obj)
    display(card.summary, *([card.figure] if card.figure is not None else []))


def register(ip: Any = None) -> None:
    """Register the displays with IPython's formatter of `_ipython_display_` (one printer per type: it emits
    the summary and the chart as two outputs) and install the drawer `plan.show` calls."""
    engine.display.install(show)
    ip = ip or _ipython()
    if ip is None:
        return
    formatter = ip.display_formatter.ipython_display_formatter
    for cls in CARDS:
        formatter.for_type(cls, display_card)


def load_ipython_extension(ip: Any) -> None:
    """`%load_ext engine.notebook`."""
    register(ip)


# ----------------------------------------------------------------------------- what-if sliders


@dataclass
class WhatIfControls:
    """Sliders over `engine.compare.what_if`: one GPU model's FLOP/s and one link level's bandwidth; each change
    re-plans and redraws in `output`. Displays as the widgets."""

    plan: Plan
    cluster: Cluster
    box: Any
    controls: dict[str, Any]
    output: Any
    time_budget_s: float | None = None
    last: WhatIf | None = None
    """The what-if drawn last (None until a slider moves)."""

    def result(self) -> WhatIf:
        """The what-if of the sliders' current values."""
        c = {k: w.value for k, w in self.controls.items()}
        link = (c["level"], c["bandwidth"]) if c.get("level") else None
        return what_if(self.plan, self.cluster, flops_scale={c["gpu"]: c["flops"]}, link_scale=link,
                       time_budget_s=self.time_budget_s)

    def redraw(self, _change: Any = None) -> WhatIf:
        """Re-plan at the sliders' values and draw the result's card in `output`."""
        from IPython.display import display

        result = self.last = self.result()
        with self.output:
            self.output.clear_output(wait=True)
            display(result)
        return result

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        return self.box._repr_mimebundle_(include=include, exclude=exclude)


def what_if_widget(plan: Plan, cluster: Cluster, *, time_budget_s: float | None = None) -> WhatIfControls:
    """Sliders that call `engine.compare.what_if(plan, cluster, ...)` and redraw the re-planned timeline (needs
    ipywidgets, in the notebook extra)."""
    widgets = require("ipywidgets")
    levels = sorted(cluster.network.bandwidth_Bps)
    controls = {"gpu": widgets.Dropdown(options=sorted({d.gpu_model for d in cluster.devices}), description="GPU model"),
                "flops": widgets.FloatSlider(1.0, min=0.25, max=4.0, step=0.25, description="FLOP/s x",
                                             continuous_update=False),
                "level": widgets.Dropdown(options=levels, description="link level"),
                "bandwidth": widgets.FloatSlider(1.0, min=0.25, max=16.0, step=0.25, description="bandwidth x",
                                                 continuous_update=False, disabled=not levels)}
    output = widgets.Output()
    box = widgets.VBox([widgets.HBox([controls["gpu"], controls["flops"]]),
                        widgets.HBox([controls["level"], controls["bandwidth"]]), output])
    panel = WhatIfControls(plan, cluster, box, controls, output, time_budget_s)
    for w in controls.values():
        w.observe(panel.redraw, names="value")
    return panel


register()
