"""Where a benchmark's table goes besides the terminal: CSV, markdown and a PNG plot.

Every throughput benchmark hands one `Results` to `write_results`, which writes
`<name>.csv` and `<name>.md` (the table as printed, one row per measured size) and
`<name>.png`: GB/s against chunk size on a log2 axis, one panel per phase (write, read,
...), one line for kvstrata and one for each reference measured in the same run, the run's
command, date and machine in the title. Only this module plots, so every figure in
docs/img/ looks the same and says where it came from.

matplotlib is optional (the `bench` extra): without it the table files are still
written and one line says the plot was skipped. The figure is drawn on matplotlib's Agg
canvas directly, never through pyplot, so no display is needed and no global backend
state is touched.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import math
import os
import platform
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
DPI = 100
PANEL_INCHES = (4.6, 3.6)


@dataclass(frozen=True)
class Line:
    """One subject's GB/s at each of the run's sizes (NaN where it was not measured).

    kvstrata's lines are solid, references dashed; a label names the same subject in every
    panel, and keeps one colour across them.
    """

    label: str
    gbps: Sequence[float]
    reference: bool = False


@dataclass(frozen=True)
class Panel:
    """One phase of the benchmark (a write, a read) with its lines, plotted side by side."""

    title: str
    lines: Sequence[Line]


@dataclass
class Results:
    """A benchmark run as it is written out.

    Invariant: every line of every panel has one value per entry of `sizes_bytes` (the
    x axis), and every row of the table has one cell per column.
    """

    name: str  # file stem: <name>.csv, <name>.md, <name>.png
    title: str  # what was run, when and where (see `run_title`)
    columns: list[str]
    rows: list[list[object]] = field(default_factory=list)
    sizes_bytes: list[int] = field(default_factory=list)
    panels: list[Panel] = field(default_factory=list)
    x_label: str = "chunk size"

    def __post_init__(self) -> None:
        self.check()

    def column(self, name: str) -> list:
        """The cells of one column, a row's size after another's (as a line's values go)."""
        index = self.columns.index(name)
        return [row[index] for row in self.rows]

    def check(self) -> None:
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"row {row} has {len(row)} cells for {len(self.columns)} columns")
        for panel in self.panels:
            for line in panel.lines:
                if len(line.gbps) != len(self.sizes_bytes):
                    raise ValueError(
                        f"{panel.title}/{line.label}: {len(line.gbps)} values for {len(self.sizes_bytes)} sizes"
                    )


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help=f"directory for the table (CSV, markdown) and the plot (PNG) (default: {DEFAULT_OUT})",
    )


def machine() -> str:
    """The machine in a few words: CPU model, cores, memory, OS."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            model = next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    try:
        memory = f", {round(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30)} GiB"
    except (ValueError, OSError, AttributeError):
        memory = ""
    return f"{model}, {os.cpu_count()} cores{memory}, {platform.system()} {platform.release()}"


def command_line(script: str, args: argparse.Namespace) -> str:
    """The command that reproduces the run: every option with the value it had, defaults included."""
    options = [
        f"--{name.replace('_', '-')} {value}" for name, value in vars(args).items() if name != "out" and value is not None
    ]
    return " ".join([f"benchmarks/{script}", *options])


def run_title(script: str, args: argparse.Namespace, extra: str = "") -> str:
    """The plot's title: command, date and machine (and `extra`, such as a GPU's name)."""
    where = machine() + (f", {extra}" if extra else "")
    return f"{command_line(script, args)} | {datetime.date.today().isoformat()} | {where}"


def size_label(size_bytes: int) -> str:
    if size_bytes >= 1 << 30 and size_bytes % (1 << 30) == 0:
        return f"{size_bytes >> 30} GiB"
    if size_bytes >= 1 << 20 and size_bytes % (1 << 20) == 0:
        return f"{size_bytes >> 20} MiB"
    return f"{size_bytes / 1024:g} KiB"


def cell(value: object) -> str:
    """A table cell as text: floats to 4 significant digits, the rest as they print."""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def write_csv(results: Results, path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(results.columns)
        writer.writerows([cell(value) for value in row] for row in results.rows)


def write_markdown(results: Results, path: Path) -> None:
    lines = [
        results.title,
        "",
        "| " + " | ".join(results.columns) + " |",
        "|" + "---|" * len(results.columns),
        *("| " + " | ".join(cell(value) for value in row) + " |" for row in results.rows),
    ]
    path.write_text("\n".join(lines) + "\n")


def write_png(results: Results, path: Path) -> None:
    """Draw the panels on an Agg canvas; raises ImportError without matplotlib."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    labels = list(dict.fromkeys(line.label for panel in results.panels for line in panel.lines))
    colours = {label: f"C{i % 10}" for i, label in enumerate(labels)}
    width, height = PANEL_INCHES
    figure = Figure(figsize=(width * len(results.panels), height + 0.6), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, len(results.panels), squeeze=False)[0]
    for ax, panel in zip(axes, results.panels):
        for line in panel.lines:
            ax.plot(
                results.sizes_bytes,
                line.gbps,
                label=line.label,
                color=colours[line.label],
                linestyle="--" if line.reference else "-",
                linewidth=1.3 if line.reference else 2.2,
                marker="o" if not line.reference else "s",
                markersize=4,
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(results.sizes_bytes, [size_label(size) for size in results.sizes_bytes])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(results.x_label)
        ax.set_ylabel("GB/s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    chars_per_line = int(width * len(results.panels) * 15)
    figure.suptitle("\n".join(textwrap.wrap(results.title, chars_per_line)), fontsize=8)
    figure.savefig(path, format="png", dpi=DPI)


def write_results(results: Results, out: Path) -> list[Path]:
    """Write the table (CSV, markdown) and, where matplotlib is installed, the plot (PNG)
    into `out`; print where they went, or that the plot was skipped. Returns the files written."""
    results.check()
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{results.name}.csv", out / f"{results.name}.md"]
    write_csv(results, written[0])
    write_markdown(results, written[1])
    png = out / f"{results.name}.png"
    try:
        write_png(results, png)
    except ImportError as missing:
        print(f"plot skipped ({missing}; pip install matplotlib, the `bench` extra); table in {written[0]}")
        return written
    written.append(png)
    print("wrote " + ", ".join(str(path) for path in written))
    return written


@dataclass(frozen=True)
class Point:
    """One subject at one setting on a scatter (`write_scatter`): references hollow."""

    label: str
    x: float
    y: float
    reference: bool = False


def write_scatter(name: str, title: str, x_label: str, y_label: str, points: Sequence[Point], out: Path) -> list[Path]:
    """A trade-off plot (one point per subject and setting, e.g. hit ratio against writes):
    the table as CSV and markdown, and the PNG where matplotlib is installed."""
    results = Results(name, title, ["label", x_label, y_label], [[p.label, p.x, p.y] for p in points])
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{name}.csv", out / f"{name}.md"]
    write_csv(results, written[0])
    write_markdown(results, written[1])
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as missing:
        print(f"plot skipped ({missing}; pip install matplotlib, the `bench` extra); table in {written[0]}")
        return written
    width, height = PANEL_INCHES
    figure = Figure(figsize=(width * 2.2, height * 1.4), dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    from matplotlib import colormaps

    palette = colormaps["tab20"]
    for i, point in enumerate(points):
        colour = palette(i % 20)
        ax.scatter([point.x], [point.y], s=46, color=colour, marker="s" if point.reference else "o",
                   facecolors="none" if point.reference else colour, label=point.label)  # fmt: skip
    ax.set_xlim(left=0)
    ax.set_ylim(0, max([1.0] + [p.y * 1.05 for p in points]))
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    figure.suptitle("\n".join(textwrap.wrap(title, int(width * 2.2 * 15))), fontsize=8)
    png = out / f"{name}.png"
    figure.savefig(png, format="png", dpi=DPI)
    written.append(png)
    print("wrote " + ", ".join(str(path) for path in written))
    return written
