"""Loss and evaluation loss against step, drawn as a self-contained SVG (the README's loss curve).

    PYTHONPATH=. python bench/plot_metrics.py metrics.jsonl [more.jsonl ...] --out docs/loss_curve.svg

Reads each metrics file (`hap run PLAN --metrics FILE`) as the workbench's Runs page does (app.runs:
rank 0's loss per step, rank 0's evaluation records) and writes the SVG by hand (axes, ticks, grid,
one polyline per series, a legend), so it needs no plotting package. One run: loss in blue, eval loss
in orange; several runs: a colour per run, eval loss dashed. Prints the summary figures it drew.
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `app` and `engine` from a source checkout

from app.runs import MetricsError, Run, load_run, summarise  # noqa: E402

PALETTE = ("#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#b279a2", "#9d755d", "#79706e")
"""Series colours (Tableau 10, as Altair draws the Runs page)."""
WIDTH, HEIGHT = 720, 380
MARGIN = {"left": 64, "right": 20, "top": 40, "bottom": 50}
LEGEND_ROW = 18


@dataclass(frozen=True)
class Series:
    """One polyline: (step, value) points in step order."""

    label: str
    color: str
    points: tuple[tuple[float, float], ...]
    dashed: bool = False
    markers: bool = False


@dataclass(frozen=True)
class Axis:
    """A linear axis: data domain [lo, hi] onto pixels [start, end] (end < start for y, which grows upwards)."""

    lo: float
    hi: float
    start: float
    end: float
    ticks: tuple[float, ...]

    def __call__(self, v: float) -> float:
        return self.start + (v - self.lo) / (self.hi - self.lo) * (self.end - self.start)


def series_of(runs: list[Run]) -> list[Series]:
    """Loss and eval loss of every run (a run without evaluations gets only its loss)."""
    out = []
    for k, run in enumerate(runs):
        one = len(runs) == 1
        color, eval_color = (PALETTE[0], PALETTE[1]) if one else (PALETTE[k % len(PALETTE)],) * 2
        prefix = "" if one else f"{run.name}: "
        out.append(Series(f"{prefix}loss", color, tuple((s.step, s.loss) for s in run.steps if s.loss is not None)))
        evals = tuple((e.step, e.eval_loss) for e in run.evals if e.eval_loss is not None)
        if evals:
            out.append(Series(f"{prefix}eval loss", eval_color, evals, dashed=not one, markers=True))
    return out


def nice_step(span: float, count: int) -> float:
    """The 1, 2 or 5 x 10^k tick spacing that splits `span` into at most about `count` intervals."""
    raw = span / max(count, 1) if span > 0 else 1.0
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))


def axis(lo: float, hi: float, start: float, end: float, count: int = 6) -> Axis:
    """An axis whose domain is widened to whole ticks around [lo, hi]."""
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    step = nice_step(hi - lo, count)
    lo, hi = math.floor(lo / step + 1e-9) * step, math.ceil(hi / step - 1e-9) * step
    ticks = tuple(lo + i * step for i in range(round((hi - lo) / step) + 1))
    return Axis(lo, hi, start, end, ticks)


def tick_label(v: float, ticks: tuple[float, ...]) -> str:
    """A tick value with as many decimals as the spacing needs (0.25 -> 2, 50 -> 0)."""
    step = ticks[1] - ticks[0] if len(ticks) > 1 else 1.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9)) if step < 1 else 0
    return f"{v:.{decimals}f}"


def svg(series: list[Series], title: str) -> str:
    """The whole picture: title, grid and ticks, axis titles, the series, then the legend at the top right."""
    pts = [p for s in series for p in s.points]
    if not pts:
        raise ValueError("nothing to draw: no step has a finite loss")
    x = axis(min(p[0] for p in pts), max(p[0] for p in pts), MARGIN["left"], WIDTH - MARGIN["right"])
    y = axis(min(p[1] for p in pts), max(p[1] for p in pts), HEIGHT - MARGIN["bottom"], MARGIN["top"], count=5)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif" font-size="12">',
             f"<title>{escape(title)}</title>",
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>',
             *_grid(x, y), *(_polyline(s, x, y) for s in series), *_legend(series)]
    return "\n".join(parts + ["</svg>"]) + "\n"


def _grid(x: Axis, y: Axis) -> list[str]:
    out = ['<g class="grid" stroke="#e6e6e6">']
    out += [f'<line x1="{x(t):.1f}" y1="{y.start}" x2="{x(t):.1f}" y2="{y.end}"/>' for t in x.ticks]
    out += [f'<line x1="{x.start}" y1="{y(t):.1f}" x2="{x.end}" y2="{y(t):.1f}"/>' for t in y.ticks]
    out += ["</g>", '<g class="axes" stroke="#333">',
            f'<line x1="{x.start}" y1="{y.start}" x2="{x.end}" y2="{y.start}"/>',
            f'<line x1="{x.start}" y1="{y.start}" x2="{x.start}" y2="{y.end}"/>', "</g>", '<g class="ticks" fill="#333">']
    out += [f'<text x="{x(t):.1f}" y="{y.start + 16}" text-anchor="middle">{tick_label(t, x.ticks)}</text>' for t in x.ticks]
    out += [f'<text x="{x.start - 6}" y="{y(t) + 4:.1f}" text-anchor="end">{tick_label(t, y.ticks)}</text>' for t in y.ticks]
    mid_y = (y.start + y.end) / 2
    out += ["</g>", f'<text x="{(x.start + x.end) / 2}" y="{HEIGHT - 12}" text-anchor="middle">step</text>',
            f'<text x="16" y="{mid_y}" text-anchor="middle" transform="rotate(-90 16 {mid_y})">loss</text>']
    return out


def _polyline(s: Series, x: Axis, y: Axis) -> str:
    coords = " ".join(f"{x(a):.1f},{y(b):.1f}" for a, b in s.points)
    dash = ' stroke-dasharray="6 3"' if s.dashed else ""
    out = [f'<g class="series" data-label={quoteattr(s.label)}>',
           f'<polyline fill="none" stroke="{s.color}" stroke-width="2"{dash} points="{coords}"/>']
    if s.markers:
        out += [f'<circle cx="{x(a):.1f}" cy="{y(b):.1f}" r="3" fill="{s.color}"/>' for a, b in s.points]
    return "\n".join(out + ["</g>"])


def _legend(series: list[Series]) -> list[str]:
    width = 24 + 7 * max(len(s.label) for s in series)
    left, top = WIDTH - MARGIN["right"] - width - 8, MARGIN["top"] + 8
    out = [f'<g class="legend"><rect x="{left}" y="{top}" width="{width}" height="{LEGEND_ROW * len(series) + 6}" '
           'fill="white" fill-opacity="0.85" stroke="#ccc"/>']
    for k, s in enumerate(series):
        cy = top + 12 + LEGEND_ROW * k
        dash = ' stroke-dasharray="6 3"' if s.dashed else ""
        out += [f'<line x1="{left + 6}" y1="{cy}" x2="{left + 20}" y2="{cy}" stroke="{s.color}" stroke-width="2"{dash}/>',
                f'<text x="{left + 26}" y="{cy + 4}">{escape(s.label)}</text>']
    return out + ["</g>"]


def summary_line(run: Run) -> str:
    s = summarise(run)
    figures = [f"{s.steps} steps on {s.ranks} ranks", f"loss {s.first_loss:.4f} -> {s.last_loss:.4f} (min {s.min_loss:.4f})"]
    if s.eval_drop_pct is not None:
        figures.append(f"eval loss {s.first_eval_loss:.4f} -> {s.last_eval_loss:.4f} ({s.eval_drop_pct:.1f}% lower)")
    return f"{run.name}: " + ", ".join(figures)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", nargs="+", type=Path, help="metrics files (JSON lines of `hap run --metrics`)")
    p.add_argument("--out", type=Path, default=Path("docs/loss_curve.svg"), help="the SVG to write")
    p.add_argument("--title", default="Training and evaluation loss")
    args = p.parse_args(argv)
    try:
        runs = [load_run(path.name, path.read_text(encoding="utf-8", errors="replace")) for path in args.metrics]
        picture = svg(series_of(runs), args.title)
    except (MetricsError, OSError, ValueError) as e:
        print(f"plot_metrics: error: {e}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(picture, encoding="utf-8")
    for run in runs:
        print(summary_line(run))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
