"""`kvstrata bench`: every configured tier measured beside its reference, on scratch copies
that are gone afterwards (also after Ctrl-C); the live store's locations are left as they
were. In-process, tiny sizes."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console

from kvstrata.bench import add_bench_arguments, run_bench
from kvstrata.bench import measure as bench_measure
from kvstrata.bench.scratch import SCRATCH_PREFIX
from kvstrata.bench.tiers import chunk_count
from kvstrata.config import ObjectTierConfig, load_config
from kvstrata.tiers.object_store import ObjectTier
from tests.utils import key

REFERENCES = {"cpu": "numpy memcpy", "disk": "raw pwrite/preadv", "object": "fsspec PrivateLocalFileSystem put/get"}


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(list(argv))


def tree(root: Path) -> list[str]:
    """Every file and directory under `root`, as the test sees the node's locations."""
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))


@pytest.fixture
def all_tiers(tmp_path):
    """cpu + disk + object (a local file:// root), none of whose locations exist yet but shm_dir."""
    shm = tmp_path / "shm"
    shm.mkdir()
    config = load_config(
        {
            "tiers": {
                "cpu": {"capacity": "4MiB", "shm_dir": str(shm)},
                "disk": {"path": str(tmp_path / "node" / "disk"), "capacity": "4MiB"},
                # auto_mkdir: a local root needs the fan-out directories made
                "object": {"url": f"file://{tmp_path}/bucket/kv", "storage_options": {"auto_mkdir": True}},
            }
        }
    )
    return config, shm


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait(timeout=30)
    return process.pid


def test_every_configured_tier_beside_its_reference_and_nothing_left(all_tiers, tmp_path):
    config, shm = all_tiers
    before = tree(tmp_path)
    killed = shm / f"{SCRATCH_PREFIX}{dead_pid()}"  # what a bench that was killed left behind
    killed.mkdir()
    (killed / "reference-1").write_bytes(b"x" * 4096)
    console = Console(record=True, width=250)
    assert run_bench(config, console, bench_args("--sizes", "64,128KiB", "--bytes", "1MiB", "--rounds", "2")) == 0
    text = console.export_text()
    for tier, reference in REFERENCES.items():
        rows = [line for line in text.splitlines() if line.startswith(f"│ {tier} ")]
        assert len(rows) == 2, text
        assert all(reference in row for row in rows), text
        assert ["64 KiB" in rows[0], "128 KiB" in rows[1]] == [True, True], text
    assert "moving 1 MiB per measurement, medians of 2 rounds" in text
    # the shared memory, the disk path and the bucket as they were: no scratch copy, no
    # directory made for them, and the killed bench's leftovers gone
    assert tree(tmp_path) == before


def test_json_rows_have_positive_figures_and_leave_out_unconfigured_tiers(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    config = load_config({"tiers": {"cpu": {"capacity": "1MiB", "shm_dir": str(shm)}}})
    out = StringIO()
    assert run_bench(config, Console(file=out, width=200), bench_args("--sizes", "64", "--bytes", "1MiB", "--json")) == 0
    rows = json.loads(out.getvalue())
    assert [row["tier"] for row in rows] == ["cpu"]
    assert rows[0]["chunks"] == 16 and rows[0]["moved_bytes"] == 1 << 20 and rows[0]["error"] is None
    for field in ("write_gbps", "ref_write_gbps", "write_ratio", "read_gbps", "ref_read_gbps", "read_ratio"):
        assert rows[0][field] > 0, rows[0]
    assert os.listdir(shm) == []

    table = Console(record=True, width=250)
    assert run_bench(config, table, bench_args("--sizes", "64", "--bytes", "256KiB", "--rounds", "1")) == 0
    text = table.export_text()
    assert "│ cpu " in text and "disk" not in text and "object" not in text


def test_interrupted_bench_removes_its_scratch_and_says_so(all_tiers, tmp_path, monkeypatch):
    config, _ = all_tiers
    before = tree(tmp_path)
    calls = []
    real_timed = bench_measure.timed

    def interrupted(work):  # Ctrl-C at the disk row's second timed phase: its store and files exist
        calls.append(work)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_timed(work)

    monkeypatch.setattr(bench_measure, "timed", interrupted)
    console = Console(record=True, width=200)
    assert run_bench(config, console, bench_args("--sizes", "64", "--bytes", "512KiB", "--tiers", "disk")) == 130
    assert "interrupted" in console.export_text()
    assert tree(tmp_path) == before


def test_a_tier_that_cannot_work_is_named_with_its_reason_and_the_others_measured(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    (tmp_path / "not-a-directory").write_text("")
    config = load_config(
        {
            "tiers": {
                "cpu": {"capacity": "1MiB", "shm_dir": str(shm)},
                "object": {"url": f"file://{tmp_path}/not-a-directory/kv", "storage_options": {"auto_mkdir": True}},
            }
        }
    )
    console = Console(record=True, width=250)
    assert run_bench(config, console, bench_args("--sizes", "64", "--bytes", "256KiB", "--rounds", "1")) == 1
    text = console.export_text()
    assert "object 64 KiB: failed: 0 of 4 uploads landed" in text, text
    cpu_row = next(line for line in text.splitlines() if line.startswith("│ cpu "))
    assert "failed" not in cpu_row and "—" not in cpu_row
    assert os.listdir(shm) == []


def test_a_measurement_is_capped_by_the_tiers_capacity(tmp_path):
    config = load_config(
        {
            "tiers": {
                "cpu": {"capacity": "64MiB", "shm_dir": str(tmp_path)},
                "disk": {"path": str(tmp_path / "disk"), "capacity": "1MiB"},
            }
        }
    )
    assert chunk_count(config, "cpu", 1 << 20, 16 << 20) == (16, None)
    count, capped_by = chunk_count(config, "disk", 256 << 10, 16 << 20)
    assert capped_by == "tiers.disk.capacity" and 1 <= count < 4  # each record also has its header
    assert chunk_count(config, "disk", 2 << 20, 16 << 20) == (0, "tiers.disk.capacity")


def test_bad_arguments_exit_2(tmp_path):
    config = load_config({"tiers": {"cpu": {"capacity": "1MiB", "shm_dir": str(tmp_path)}}})
    console = Console(file=StringIO())
    assert run_bench(config, console, bench_args("--sizes", "3")) == 2  # not a multiple of 4 KiB
    assert run_bench(config, console, bench_args("--tiers", "disk")) == 2  # not configured
    assert os.listdir(tmp_path) == []


def test_a_live_stores_sweep_neither_counts_nor_deletes_the_bench_scratch(memory_bucket):
    """The bench's scratch objects live under the live root (`<url>/.kvstrata-bench-<pid>/`):
    the live store's sweep must not count them against `capacity`, nor delete them."""
    payload = np.zeros(8192, np.uint8)
    live = ObjectTier(ObjectTierConfig(url=memory_bucket, capacity=3 * (8192 + 4096)))
    scratch = ObjectTier(ObjectTierConfig(url=f"{memory_bucket}/{SCRATCH_PREFIX}1"))
    try:
        assert live.put_many("ns", [(key(i), payload) for i in range(3)]) == [True] * 3
        assert scratch.put_many("ns", [(key(i), payload) for i in range(10, 20)]) == [True] * 10
        entries = live.scan()
        assert sorted(entry.key for entry in entries) == sorted(key(i) for i in range(3))
        assert len(live.apply_limits(entries)) == 3  # within capacity: nothing deleted
        assert scratch.list_keys("ns") == {key(i) for i in range(10, 20)}
    finally:
        live.close()
        scratch.close()
