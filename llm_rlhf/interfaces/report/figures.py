"""Plot primitives: matplotlib's object API on the Agg canvas (no pyplot state, no display needed), the
report's style, a figure as PNG bytes, lines smoothed when long, twin axes, one legend over several axes.
matplotlib is imported inside the functions: it is an optional dependency of the core.
"""

from __future__ import annotations

import io

from llm_rlhf.interfaces.report.numbers import smooth

SMOOTH_ABOVE = 30  # more points than this: raw line faint, a centred moving average on top


def plot_style():
    import matplotlib  # optional for the core, heavy: imported only when a figure is drawn

    return matplotlib.rc_context(
        {
            "font.size": 9,
            "axes.titlesize": 10,
            "axes.titleweight": "bold",
            "axes.grid": True,
            "grid.alpha": 0.3,
            "axes.spines.top": False,
            "legend.fontsize": 8,
            "legend.frameon": False,
            "lines.linewidth": 1.5,
            "axes.formatter.useoffset": False,  # constant series would read "1e-14+1e-2"
        }
    )


def new_figure(nrows: int, ncols: int, width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # optional, heavy: only when drawing
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def png_bytes(fig) -> bytes:
    for ax in fig.axes:
        _widen_flat_ylim(ax)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return buf.getvalue()


def _widen_flat_ylim(ax) -> None:
    """A constant series (β of a fixed controller, EOS rate 1.0) gets a readable ±5% y range instead
    of ticks spanning its floating-point noise."""
    low, high = ax.dataLim.intervaly
    if ax.lines and ax.get_autoscaley_on() and 0 <= high - low <= 1e-9 * max(1.0, abs(high)):
        pad = 0.05 * abs(high) or 0.05
        ax.set_ylim(low - pad, high + pad)


def nth_color(i: int):
    import matplotlib  # optional, heavy: only when drawing

    return matplotlib.colormaps["tab10"](i % 10)


def plot_line(ax, x, y, label: str | None = None, color=None, **kwargs):
    """Raw line; with many points, the raw line faint and a moving average over ~5% of them on top."""
    if len(x) > SMOOTH_ABOVE:
        (raw,) = ax.plot(x, y, color=color, alpha=0.25, linewidth=1)
        return ax.plot(x, smooth(y, len(x) // 20 * 2 + 1), color=raw.get_color(), label=label, **kwargs)[0]
    return ax.plot(
        x, y, color=color, label=label, marker="o" if len(x) < 12 else None, markersize=3, **kwargs
    )[0]


def no_data(ax, text: str = "no data") -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def twin_axis(ax, color):
    right = ax.twinx()
    right.spines["right"].set_visible(True)
    right.grid(False)
    right.tick_params(axis="y", colors=color)
    return right


def add_legend(ax, *more_axes) -> None:
    handles, labels = [], []
    for a in (ax, *more_axes):
        h, lab = a.get_legend_handles_labels()
        handles, labels = handles + h, labels + lab
    if handles:
        ax.legend(handles, labels, loc="best")
