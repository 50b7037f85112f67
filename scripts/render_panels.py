"""Draw a Grafana dashboard's panels with matplotlib, from query results: the picture
half of scripts/render_dashboard.py.

Only what examples/grafana/kvstrata.json uses: rows (collapsed ones as a header),
time series (stacking, fill, dashed and right-axis overrides by regex, fixed colours),
stats, bar gauges and state timelines, laid out on the dashboard's 24-column grid in
Grafana's dark theme. `results` maps a panel id to, per target, Prometheus' series (each
with `values` or `value`, and the `legend` already formatted).
"""

from __future__ import annotations

import io
import math
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator  # noqa: E402

BACKGROUND, PANEL, BORDER = "#111217", "#181b1f", "#2c3235"
TEXT, DIM, GRID = "#ccccdc", "#8e8e8e", "#2a2d32"
PALETTE = ["#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0", "#37872d", "#fade2a"]
NAMED = {"green": "#73bf69", "red": "#f2495c", "orange": "#ff9830", "yellow": "#fade2a", "blue": "#5794f2"}
WIDTH_PX, CELL_PX, DPI = 1800, 30, 100


def draw_dashboard(dashboard: dict, results: dict[int, list[list[dict]]], start: float, end: float,
                   out: Path, subtitle: str) -> int:  # fmt: skip
    """Draw every visible panel at its grid position; returns the PNG's size in bytes."""
    visible = list(_visible(dashboard["panels"]))
    header_px = 70
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in visible)
    height_px = header_px + rows * CELL_PX + 10
    fig = plt.figure(figsize=(WIDTH_PX / DPI, height_px / DPI), dpi=DPI, facecolor=BACKGROUND)
    plt.rcParams.update({"font.size": 8, "text.color": TEXT, "axes.labelcolor": TEXT, "xtick.color": DIM,
                         "ytick.color": DIM, "axes.edgecolor": BORDER})  # fmt: skip
    fig.text(10 / WIDTH_PX, 1 - 22 / height_px, dashboard["title"], fontsize=15, weight="bold", color=TEXT)
    variables = "   ".join(f"{v.get('label', v['name'])}: {'Prometheus' if v['type'] == 'datasource' else 'All'}"
                           for v in dashboard["templating"]["list"])  # fmt: skip
    fig.text(10 / WIDTH_PX, 1 - 44 / height_px, variables, fontsize=9, color=DIM)
    fig.text(1 - 10 / WIDTH_PX, 1 - 22 / height_px, subtitle, fontsize=8, color=DIM, ha="right")

    def box(grid: dict) -> list[float]:
        pad = 4
        left = grid["x"] * WIDTH_PX / 24 + pad
        top = header_px + grid["y"] * CELL_PX + pad
        width = grid["w"] * WIDTH_PX / 24 - 2 * pad
        height = grid["h"] * CELL_PX - 2 * pad
        return [left / WIDTH_PX, 1 - (top + height) / height_px, width / WIDTH_PX, height / height_px]

    for panel in visible:
        rect = box(panel["gridPos"])
        if panel["type"] == "row":
            arrow = "\u25b8" if panel.get("collapsed") else "\u25be"
            fig.text(rect[0], rect[1] + rect[3] / 2, f"{arrow} {panel['title']}", fontsize=11, weight="bold",
                     color=TEXT, va="center")  # fmt: skip
            continue
        frame = fig.add_axes(rect)
        frame.set_facecolor(PANEL)
        frame.set_xticks([])
        frame.set_yticks([])
        for spine in frame.spines.values():
            spine.set_color(BORDER)
        frame.text(8 / (rect[2] * WIDTH_PX), 1 - 12 / (rect[3] * height_px), panel["title"], fontsize=9,
                   weight="bold", color=TEXT, va="center", transform=frame.transAxes)  # fmt: skip
        inner = _inset(fig, rect, height_px, top_px=24)
        draw = {"timeseries": _timeseries, "stat": _stat, "bargauge": _bargauge, "state-timeline": _state_timeline}
        draw[panel["type"]](fig, inner, panel, results.get(panel["id"], []), start, end, height_px)

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", facecolor=BACKGROUND, dpi=DPI)
    plt.close(fig)
    return _save_small(buffer.getvalue(), out)


def _visible(items: list[dict]):
    for panel in items:
        yield panel
        if not panel.get("collapsed"):
            yield from _visible(panel.get("panels", []))


def _inset(fig, rect: list[float], height_px: int, top_px: int) -> list[float]:
    top = top_px / height_px
    return [rect[0], rect[1], rect[2], rect[3] - top]


def _color(name: str | None, index: int) -> str:
    if name is None:
        return PALETTE[index % len(PALETTE)]
    return NAMED.get(name, name)


def _overrides(panel: dict, name: str) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for override in panel["fieldConfig"].get("overrides", []):
        if override["matcher"]["id"] == "byRegexp" and re.fullmatch(override["matcher"]["options"], name):
            props.update({p["id"]: p["value"] for p in override["properties"]})
    return props


def _format(unit: str, decimals: int | None = None):
    """A function value -> text in Grafana's spirit for the units the dashboard uses."""

    def scaled(value: float, base: float, suffixes: list[str]) -> str:
        magnitude = 0
        while abs(value) >= base and magnitude < len(suffixes) - 1:
            value /= base
            magnitude += 1
        if decimals is not None:
            number = f"{value:.{decimals}f}"
        else:  # Grafana-like: integers as they are, other values to three significant digits
            number = f"{value:.0f}" if value == int(value) else f"{value:.3g}"
        return f"{number} {suffixes[magnitude]}".strip()

    def text(value: float, _pos: Any = None) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "–"
        if unit == "percentunit":
            return f"{value * 100:.{1 if decimals is None else decimals}f}%"
        if unit == "bytes":
            return scaled(value, 1024, ["B", "KiB", "MiB", "GiB", "TiB"])
        if unit == "Bps":
            return scaled(value, 1000, ["B/s", "kB/s", "MB/s", "GB/s"])
        if unit == "s":
            return f"{value * 1000:.1f} ms" if abs(value) < 1 else f"{value:.2f} s"
        suffix = {"cps": " c/s", "reqps": " req/s"}.get(unit, "")
        return scaled(value, 1000, ["", "K", "M", "G"]) + suffix

    return text


def _timeseries(fig, rect, panel, per_target, start, end, height_px) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    custom = defaults.get("custom", {})
    stacked = custom.get("stacking", {}).get("mode") == "normal"
    legend_px = 16 * math.ceil(sum(len(t) for t in per_target) / max(1, int(rect[2] * WIDTH_PX // 170)))
    has_right = any(_overrides(panel, s["legend"]).get("custom.axisPlacement") == "right" for t in per_target for s in t)
    width = rect[2] - (0.07 if has_right else 0.045)
    plot = [rect[0] + 0.03, rect[1] + (legend_px + 22) / height_px, width, rect[3] - (legend_px + 30) / height_px]
    ax = fig.add_axes(plot)
    ax.set_facecolor(PANEL)
    ax.grid(color=GRID, linewidth=0.6)
    for spine in ax.spines.values():
        spine.set_visible(False)
    right = None
    grid = np.arange(start, end + 1e-6, 5.0)
    stack = np.zeros_like(grid)
    handles, index = [], 0
    for series_list in per_target:
        for series in series_list:
            values = np.full_like(grid, np.nan)
            for when, value in series["values"]:
                slot = int(round((float(when) - start) / 5.0))
                if 0 <= slot < len(grid) and math.isfinite(float(value)):  # Grafana leaves out +-Inf too
                    values[slot] = float(value)
            props = _overrides(panel, series["legend"])
            color = _color(props.get("color", {}).get("fixedColor"), index)
            index += 1
            axis = ax
            if props.get("custom.axisPlacement") == "right":
                right = right or ax.twinx()
                axis = right
            times = [datetime.fromtimestamp(t) for t in grid]
            dashed = "custom.lineStyle" in props
            fill = props.get("custom.fillOpacity", custom.get("fillOpacity", 0)) / 100
            if stacked:
                top = stack + np.nan_to_num(values)
                axis.fill_between(times, stack, top, where=~np.isnan(values), color=color, alpha=max(fill, 0.25),
                                  linewidth=0)
                (line,) = axis.plot(times, np.where(np.isnan(values), np.nan, top), color=color, linewidth=1)
                stack = top
            else:
                (line,) = axis.plot(times, values, color=color, linewidth=1.1, linestyle="--" if dashed else "-")
                if fill and not dashed:
                    axis.fill_between(times, 0, np.nan_to_num(values), where=~np.isnan(values), color=color,
                                      alpha=fill, linewidth=0)
            line.set_label(series["legend"])
            handles.append(line)
    for axis, unit in ((ax, defaults.get("unit", "short")), (right, None)):
        if axis is None:
            continue
        if axis is right:
            unit = next((p.get("unit") for t in per_target for s in t if (p := _overrides(panel, s["legend"]))
                         .get("custom.axisPlacement") == "right"), defaults.get("unit", "short"))  # fmt: skip
        axis.yaxis.set_major_formatter(FuncFormatter(_format(unit or "short")))
        axis.yaxis.set_major_locator(MaxNLocator(4))
        axis.set_ylim(bottom=0)
        axis.tick_params(labelsize=7, length=0)
        for spine in axis.spines.values():
            spine.set_visible(False)
    first, last = datetime.fromtimestamp(start), datetime.fromtimestamp(end)
    ax.set_xlim(first, last)
    # Round times, none so close to the left edge that it runs into the y axis' labels.
    ticks = matplotlib.dates.AutoDateLocator(minticks=3, maxticks=6).tick_values(first, last)
    low, high = matplotlib.dates.date2num(first), matplotlib.dates.date2num(last)
    ax.set_xticks([tick for tick in ticks if low + 0.08 * (high - low) <= tick <= high])
    ax.xaxis.set_major_formatter(matplotlib.dates.DateFormatter("%H:%M:%S"))
    ax.tick_params(axis="x", labelsize=7, length=0)
    if not handles:
        ax.text(0.5, 0.5, "No data", color=DIM, ha="center", va="center", transform=ax.transAxes, fontsize=10)
        return
    columns = max(1, int(rect[2] * WIDTH_PX // 170))
    fig.legend(handles=handles, loc="lower left", bbox_to_anchor=(rect[0] + 0.004, rect[1] + 2 / height_px),
               ncol=columns, frameon=False, fontsize=7, handlelength=1.2, columnspacing=1.0, labelcolor=TEXT)  # fmt: skip


def _thresholds_color(defaults: dict, value: float) -> str:
    color = TEXT
    for step in defaults.get("thresholds", {}).get("steps", []):
        if step["value"] is None or value >= step["value"]:
            color = _color(step["color"], 0)
    return color


def _last(series: dict) -> float:
    if "value" in series:
        return float(series["value"][1])
    return float(series["values"][-1][1]) if series["values"] else math.nan


def _stat(fig, rect, panel, per_target, start, end, height_px) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    shown = [(s["legend"], _last(s)) for t in per_target for s in t]
    if not shown:
        fig.text(rect[0] + rect[2] / 2, rect[1] + rect[3] / 2, "No data", color=DIM, ha="center", va="center")
        return
    with_names = panel["options"].get("textMode") != "value"
    fmt = _format(defaults.get("unit", "short"), defaults.get("decimals"))
    for i, (name, value) in enumerate(shown):
        x = rect[0] + rect[2] * (i + 0.5) / len(shown)
        y = rect[1] + rect[3] * 0.42
        fig.text(x, y, fmt(value), fontsize=22, weight="bold", color=_thresholds_color(defaults, value), ha="center",
                 va="center")  # fmt: skip
        if with_names:
            fig.text(x, y + rect[3] * 0.33, name, fontsize=9, color=TEXT, ha="center", va="center")


def _bargauge(fig, rect, panel, per_target, start, end, height_px) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    shown = sorted((s["legend"], _last(s)) for t in per_target for s in t)
    fmt = _format(defaults.get("unit", "short"), defaults.get("decimals"))
    ax = fig.add_axes([rect[0] + 0.005, rect[1] + 0.004, rect[2] - 0.01, rect[3] - 0.008])
    ax.set_axis_off()
    ax.set_xlim(0, 1)
    ax.set_ylim(len(shown), 0)
    high = defaults.get("max", 1)
    for row, (name, value) in enumerate(shown):
        ax.text(0, row + 0.22, name, color=TEXT, fontsize=8, va="center")
        ax.barh(row + 0.62, 0.8, left=0, height=0.42, color="#22252b")
        ax.barh(row + 0.62, 0.8 * min(1.0, value / high), left=0, height=0.42, color=_thresholds_color(defaults, value))
        ax.text(0.82, row + 0.62, fmt(value), color=_thresholds_color(defaults, value), fontsize=10, va="center",
                weight="bold")  # fmt: skip


def _state_timeline(fig, rect, panel, per_target, start, end, height_px) -> None:
    defaults = panel["fieldConfig"]["defaults"]
    mapping = {}
    for entry in defaults.get("mappings", []):
        for raw, shown in entry["options"].items():
            mapping[float(raw)] = (shown["text"], _color(shown["color"], 0))
    series = sorted((s for t in per_target for s in t), key=lambda s: s["legend"])
    ax = fig.add_axes([rect[0] + 0.075, rect[1] + 18 / height_px, rect[2] - 0.08, rect[3] - 22 / height_px])
    ax.set_facecolor(PANEL)
    for spine in ax.spines.values():
        spine.set_visible(False)
    for row, s in enumerate(series):
        points = [(float(t), float(v)) for t, v in s["values"]]
        for (t0, v), (t1, _) in zip(points, points[1:] + [(end, None)]):
            _, color = mapping.get(v, (str(v), DIM))
            ax.barh(row, t1 - t0, left=t0, height=0.8, color=color, alpha=0.75, linewidth=0)
    ax.set_yticks(range(len(series)), [s["legend"] for s in series], fontsize=7)
    ax.set_ylim(len(series) - 0.5, -0.5)
    ax.set_xlim(start, end)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda t, _: datetime.fromtimestamp(t).strftime("%H:%M:%S")))
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.tick_params(length=0, labelsize=7)
    x = rect[0] + rect[2] - 0.005
    for text, color in reversed(list(mapping.values())):  # the legend, right-aligned in the title bar
        fig.text(x, rect[1] + rect[3] + 10 / height_px, f"\u25a0 {text}", fontsize=7, color=color, ha="right",
                         va="center")
        x -= (len(text) + 4) * 5.5 / WIDTH_PX


def _save_small(png: bytes, out: Path, limit: int = 300 * 1024) -> int:
    """Write the PNG; above `limit`, as a 128-colour palette image (flat panels lose nothing)."""
    if len(png) > limit:
        from PIL import Image

        image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=128, method=Image.Quantize.MEDIANCUT)
        buffer = io.BytesIO()
        image.save(buffer, format="PNG", optimize=True)
        png = buffer.getvalue()
    out.write_bytes(png)
    return len(png)
