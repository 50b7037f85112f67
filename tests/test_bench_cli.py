"""`kvstrata bench`: every configured tier measured beside its reference, on scratch space
that is gone afterwards; the node's own tier locations are never touched. In-process, tiny sizes."""

from __future__ import annotations

import json
import os

import fsspec
import pytest
import yaml

from kvstrata.cli import main


@pytest.fixture
def bench_config(tmp_path, memory_bucket):
    shm = tmp_path / "shm"
    shm.mkdir()
    disk = tmp_path / "disk"
    config = {
        "tiers": {
            "cpu": {"capacity": 1 << 20, "shm_dir": str(shm)},
            "disk": {"path": str(disk), "capacity": 1 << 20, "direct_io": False},
            "object": {"url": memory_bucket},
        }
    }
    path = tmp_path / "bench.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, shm, disk, memory_bucket


def leftovers(tmp_path, shm, bucket) -> list[str]:
    fs, root = fsspec.core.url_to_fs(bucket)
    parent = root.rsplit("/", 1)[0]
    objects = [p for p in (fs.find(parent) if fs.exists(parent) else [])]
    return sorted(os.listdir(shm)) + sorted(p for p in os.listdir(tmp_path) if "bench-" in p) + objects


def test_bench_measures_every_configured_tier_beside_its_reference_and_leaves_nothing(bench_config, tmp_path, capsys):
    path, shm, disk, bucket = bench_config
    assert main(["bench", "--config", str(path), "--sizes", "64,128", "--mib", "1"]) == 0
    out = capsys.readouterr().out
    for tier, reference in (("cpu", "numpy memcpy"), ("disk", "raw pwrite/preadv"), ("object", "fsspec MemoryFileSystem")):
        rows = [line for line in out.splitlines() if line.startswith(f"│ {tier}")]
        assert len(rows) == 2 and all(reference in row for row in rows), out
    assert leftovers(tmp_path, shm, bucket) == []
    assert not disk.exists()  # the node's own disk directory was never created


def test_bench_json_rows_and_an_unconfigured_tier_is_left_out(tmp_path, capsys):
    shm = tmp_path / "shm"
    shm.mkdir()
    path = tmp_path / "cpu.yaml"
    path.write_text(yaml.safe_dump({"tiers": {"cpu": {"capacity": 1 << 20, "shm_dir": str(shm)}}}))
    assert main(["bench", "--config", str(path), "--sizes", "64", "--mib", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["tier"] for row in rows] == ["cpu"] and rows[0]["chunks"] == 16
    assert all(rows[0][field] > 0 for field in ("write_gbps", "read_gbps", "ref_write_gbps", "ref_read_gbps"))
    assert os.listdir(shm) == []
