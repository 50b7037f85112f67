"""What an operator sees: the store's Prometheus metrics scraped from a live Ray node's
metrics port, `kvstrata status` tables, and `kvstrata up` naming a tier that cannot work.
One Ray cluster (with a known metrics export port) for the module."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.request

import pytest
import ray
import yaml

from kvstrata.actors.client import ensure_node_store, shutdown_node_store
from kvstrata.actors.store_metrics import METRICS
from kvstrata.config import load_config
from kvstrata._dev.testing import ChunkProbe
from kvstrata.tiers.records import HEADER_BYTES
from tests.utils import key, layout, local_ray, store_config

SLOT = 4096
LAYOUT = layout(model="tiny-llama", worker_bytes=SLOT)  # a store takes only a layout that digests to its namespace
NAMESPACE = LAYOUT.namespace
SCRAPE_SECONDS = 90  # Ray's agent exports every ~10 s; the store's exporter every 5 s


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_port():
    port = free_port()
    with local_ray("kvstrata-operability", _metrics_export_port=port):
        yield port


@pytest.fixture
def store(metrics_port, tmp_path):
    disk = {"path": str(tmp_path / "disk"), "capacity": 32 * (SLOT + HEADER_BYTES)}
    cfg = load_config(store_config(tmp_path, capacity=16 * SLOT, disk=disk))
    handle = ensure_node_store(cfg)
    try:
        yield handle, cfg
    finally:
        shutdown_node_store(handle)


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """The kvstrata samples on a Ray node's metrics endpoint: (name, labels) -> value."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    samples = {}
    for line in body.splitlines():
        match = re.match(r"^(ray_kvstrata_\w+)\{(.*)\} (\S+)$", line)
        if match:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
            samples[(match.group(1), labels)] = float(match.group(3))
    return samples


def value(samples, name: str, **labels: str) -> float | None:
    wanted = set(labels.items())
    found = [v for (n, have), v in samples.items() if n == name and wanted <= set(have)]
    return sum(found) if found else None


def test_store_metrics_reach_the_ray_metrics_port_with_the_store_figures(store, metrics_port):
    handle, cfg = store
    probe = ChunkProbe("probe", NAMESPACE, SLOT, LAYOUT.describe())
    keys = [key(i) for i in range(4)]
    written = probe.store_chunks(keys)
    loaded = probe.load_chunks(keys)
    assert [loaded[k] for k in keys] == written  # the hits are the bytes
    assert ray.get(handle.wait_io.remote(30))
    node = ray.get(handle.stats.remote())["node_id"]
    spec = {name: spec.prometheus_name(name) for name, spec in METRICS.items()}

    deadline = time.monotonic() + SCRAPE_SECONDS
    while True:
        samples = scrape(metrics_port)
        disk_written = value(samples, spec["kvstrata_tier_write_bytes"], node=node, tier="disk")
        if (disk_written or 0) >= 4 * SLOT or time.monotonic() > deadline:
            break
        time.sleep(1)  # polling an exporter with no event to wait on, bounded by the deadline
    probe.close()

    assert value(samples, spec["kvstrata_tier_hits"], node=node, tier="cpu") == 4
    assert value(samples, spec["kvstrata_tier_write_bytes"], node=node, tier="cpu") == 4 * SLOT
    assert value(samples, spec["kvstrata_tier_read_bytes"], node=node, tier="cpu") == 4 * SLOT
    assert disk_written == 4 * SLOT
    assert value(samples, spec["kvstrata_tier_capacity_bytes"], node=node, tier="disk") == cfg.tiers.disk.capacity
    assert value(samples, spec["kvstrata_tier_chunks"], node=node, tier="cpu", namespace=NAMESPACE) == 4
    assert value(samples, spec["kvstrata_tier_chunks"], node=node, tier="disk", namespace=NAMESPACE) == 4
    assert value(samples, spec["kvstrata_tier_up"], node=node, tier="disk") == 1
    assert value(samples, spec["kvstrata_tier_up"], node=node, tier="object") is None  # not configured
    assert value(samples, spec["kvstrata_leases_held"], node=node) == 1
    # Every gauge of the tiers configured here is exported (object, peer and directory
    # metrics need those tiers; a tier's estimates need two promotion batches from it).
    # Counters appear at their first event: Ray refuses inc(0).
    local = {
        n
        for n, m in METRICS.items()
        if m.kind == "gauge" and not n.startswith(("kvstrata_directory", "kvstrata_tier_estimate"))
    }
    missing = {n for n in local if value(samples, spec[n], node=node) is None}
    assert not missing, f"not scraped: {sorted(missing)}"


def test_status_prints_tables_of_tiers_namespaces_and_engines(store, capsys):
    from kvstrata.cli import main

    handle, _ = store
    probe = ChunkProbe("engine-a", NAMESPACE, SLOT, LAYOUT.describe())
    try:
        probe.store_chunks([key(7), key(8)])
        ray.get(probe.store.step.remote(_pin_request("engine-a", probe, [key(7)])))
        assert main(["status"]) == 0
    finally:
        probe.close()
    out = capsys.readouterr().out
    assert "cpu arena" in out and "disk" in out and "object store" in out
    assert NAMESPACE in out and "tiny-llama" in out
    engine_row = next(line for line in out.splitlines() if "engine-a" in line)
    assert re.search(r"engine-a\s*│\s*[\d.]+ s\s*│\s*1\s*│", engine_row), engine_row  # one chunk pinned
    assert "{" not in out  # a table, not JSON

    assert main(["status", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["report"]["tiers"]["cpu"]["chunks"] == 2
    assert stats["report"]["engines"]["engine-a"]["pinned"] == 1


def _pin_request(holder: str, probe: ChunkProbe, keys: list[bytes]):
    from kvstrata.protocol import StepRequest

    return StepRequest(holder, NAMESPACE, epoch=probe.epoch, pin=keys)


@pytest.mark.parametrize("broken", ["disk", "object"])
def test_up_names_a_configured_tier_that_cannot_work_and_exits_1(metrics_port, tmp_path, capsys, broken):
    from kvstrata.actors.client import get_node_store
    from kvstrata.cli import main

    cfg = store_config(tmp_path, capacity=16 * SLOT)
    if broken == "disk":
        cfg["tiers"]["disk"] = {"path": "/proc/nope", "capacity": 1 << 20}
        reason = "/proc/nope is not a writable directory"
    else:  # nothing listens on a port we just freed
        endpoint = f"http://127.0.0.1:{free_port()}"
        cfg["tiers"]["object"] = {"url": "s3://kvstrata-up/kv", "endpoint_url": endpoint, "max_attempts": 1,
                                  "storage_options": {"key": "AKIAEXAMPLEKEY", "secret": "s3cr3t-value"}}  # fmt: skip
        reason = "s3://kvstrata-up/kv"
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(cfg))
    try:
        assert main(["up", "--config", str(path)]) == 1
        out = capsys.readouterr().out
        failed = [line for line in out.splitlines() if "FAILED" in line]
        assert len(failed) == 1 and reason in failed[0], out
        assert "s3cr3t-value" not in out and "AKIAEXAMPLEKEY" not in out
        assert "cannot work" in out
        assert main(["up", "--allow-degraded", "--config", str(path)]) == 0
    finally:
        shutdown_node_store(get_node_store())


def test_status_watch_redraws_until_interrupted(store, capsys, monkeypatch):
    import kvstrata.cli as cli

    redraws = []

    def interrupt_after_two(seconds: float) -> None:
        redraws.append(seconds)
        if len(redraws) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_wait", interrupt_after_two)
    assert cli.main(["status", "--watch", "0.5"]) == 0
    assert redraws == [0.5, 0.5]
    assert "cpu arena" in capsys.readouterr().out


def test_the_command_prints_its_answer_and_no_ray_lines(store):
    import subprocess
    import sys

    # RAY_ADDRESS (set by local_ray) points the child at this module's cluster.
    done = subprocess.run([sys.executable, "-m", "kvstrata.cli", "status"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "cpu arena" in done.stdout and " INFO " not in done.stdout


@pytest.mark.parametrize("command", ["up", "status", "bench", "purge", "down"])
def test_every_subcommand_describes_itself_in_help(command, capsys):
    from kvstrata.cli import main

    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    usage, _, description = capsys.readouterr().out.partition("\n\n")
    assert f"kvstrata {command}" in usage and len(description.split("\n\n")[0]) > 40
