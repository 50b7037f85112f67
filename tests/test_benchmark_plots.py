"""The benchmarks' shared writer: a run's table lands as CSV and markdown, its plot as a
real PNG, and a machine without matplotlib still gets the table and one line saying why
there is no plot."""

from __future__ import annotations

import csv
import importlib.util
import struct
import sys
from pathlib import Path

import pytest

PLOTTING = Path(__file__).resolve().parent.parent / "benchmarks" / "plotting.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def plotting(monkeypatch):
    """benchmarks/plotting.py, loaded from its file (benchmarks/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("benchmark_plotting", PLOTTING)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def synthetic(plotting):
    """A two-panel run at three chunk sizes, kvstrata beside two references."""
    sizes_kib = [256, 1024, 8192]
    rows = [[256, 3.5, 3.9, 3.4, 1.03], [1024, 4.4, 4.7, float("nan"), 0.94], [8192, 4.6, 4.8, 4.1, 0.96]]
    results = plotting.Results(
        "synthetic",
        "benchmarks/synthetic.py --rounds 2 | 2026-11-24 | test machine",
        ["chunk KiB", "kv GB/s", "raw GB/s", "vllm GB/s", "kv/raw"],
        rows,
        [size << 10 for size in sizes_kib],
    )
    results.panels = [
        plotting.Panel("write", [
            plotting.Line("kvstrata", results.column("kv GB/s")),
            plotting.Line("raw O_DIRECT", results.column("raw GB/s"), reference=True)]),
        plotting.Panel("read", [
            plotting.Line("kvstrata", results.column("kv GB/s")),
            plotting.Line("vLLM fs tier", results.column("vllm GB/s"), reference=True)]),
    ]  # fmt: skip
    return results


def test_writes_the_table_and_a_png_sized_by_its_panels(plotting, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = synthetic(plotting)
    written = plotting.write_results(results, tmp_path / "out")

    names = sorted(path.name for path in written)
    assert names == ["synthetic.csv", "synthetic.md", "synthetic.png"]
    with (tmp_path / "out" / "synthetic.csv").open(newline="") as file:
        table = list(csv.reader(file))
    assert table == [
        ["chunk KiB", "kv GB/s", "raw GB/s", "vllm GB/s", "kv/raw"],
        ["256", "3.5", "3.9", "3.4", "1.03"],
        ["1024", "4.4", "4.7", "nan", "0.94"],
        ["8192", "4.6", "4.8", "4.1", "0.96"],
    ]
    markdown = (tmp_path / "out" / "synthetic.md").read_text().splitlines()
    assert markdown[0] == results.title
    assert markdown[2:5] == ["| chunk KiB | kv GB/s | raw GB/s | vllm GB/s | kv/raw |", "|---|---|---|---|---|",
                             "| 256 | 3.5 | 3.9 | 3.4 | 1.03 |"]  # fmt: skip

    png = (tmp_path / "out" / "synthetic.png").read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk comes first
    assert width == round(2 * plotting.PANEL_INCHES[0] * plotting.DPI), "one panel's width per panel"
    assert height == round((plotting.PANEL_INCHES[1] + 0.6) * plotting.DPI)
    assert "wrote " in capsys.readouterr().out


def test_without_matplotlib_the_table_is_written_and_the_plot_skipped_in_one_line(
    plotting, tmp_path, monkeypatch, capsys
):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # `import` of it raises ImportError

    written = plotting.write_results(synthetic(plotting), tmp_path)

    assert sorted(path.name for path in written) == ["synthetic.csv", "synthetic.md"]
    assert not (tmp_path / "synthetic.png").exists()
    assert len((tmp_path / "synthetic.csv").read_text().splitlines()) == 4
    output = capsys.readouterr().out.splitlines()
    assert len(output) == 1 and output[0].startswith("plot skipped")


def test_a_line_without_one_value_per_size_is_refused(plotting, tmp_path):
    results = synthetic(plotting)
    results.panels.append(plotting.Panel("short", [plotting.Line("kvstrata", [1.0, 2.0])]))
    with pytest.raises(ValueError, match="2 values for 3 sizes"):
        plotting.write_results(results, tmp_path)
    assert not list(tmp_path.iterdir()), "nothing is written for a malformed run"
