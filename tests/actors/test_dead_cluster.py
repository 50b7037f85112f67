"""Nothing outlives a dead cluster: every process of a Ray cluster holding a node store is
SIGKILLed (no `ray stop`, no cleanup runs), and the next store on the machine, and
`kvstrata down`, reclaim its arena segments and its disk directory, while a store that is
alive beside it (another simulated node sharing the same shm_dir) keeps every segment."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvstrata import cli
from kvstrata.actors.client import StoreUnavailable
from kvstrata.store.node_store import NodeStore
from kvstrata._dev.testing import process_tree
from kvstrata.tiers.orphans import is_locked
from tests.utils import store_config

SLOT = 64 * 1024
REPO = Path(__file__).parents[2]

# The doomed cluster: a Ray head started by this driver, in its own session directory, a
# node store on it, and chunks stored through the arena so segments and disk records exist.
_CLUSTER = """
import json, sys
import ray
from kvstrata.actors.client import ensure_node_store
from kvstrata.config import load_config
from kvstrata._dev.testing import ChunkProbe
from tests.utils import key

config = load_config(json.loads(sys.argv[1]))
ray.init(address="local", num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[2],
         namespace="kvstrata-tests-dead-cluster", log_to_driver=False)
store = ensure_node_store(config)
probe = ray.remote(ChunkProbe).options(num_cpus=0).remote("probe", "dead-ns", int(sys.argv[3]))
ray.get(probe.store_chunks.remote([key(i) for i in range(6)]), timeout=120)
ray.get(store.wait_io.remote(), timeout=60)
stats = ray.get(store.stats.remote(), timeout=60)
print(json.dumps({"store_pid": stats["pid"], "epoch": stats["epoch"]}), flush=True)
sys.stdin.read()
"""


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout_s}s")
        time.sleep(0.05)


def read_line(process: subprocess.Popen, timeout_s: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], timeout_s)
    if not ready:
        raise AssertionError(f"the cluster did not report within {timeout_s}s")
    return process.stdout.readline()


def kill_every_process(root: int) -> list[int]:
    """SIGKILL a process and everything under it, by pid: frozen first (SIGSTOP until no new
    process appears), so none of them can start a cleanup or a new child meanwhile."""
    frozen: list[int] = []
    while True:
        tree = [pid for pid in process_tree(root) if pid not in frozen]
        if not tree:
            break
        for pid in tree:
            try:
                os.kill(pid, signal.SIGSTOP)
                frozen.append(pid)
            except ProcessLookupError:
                pass
    for pid in frozen:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return frozen


@pytest.fixture
def places():
    shm = Path(tempfile.mkdtemp(prefix="kvs-dead-cluster-", dir="/dev/shm"))
    scratch = Path(tempfile.mkdtemp(prefix="kvsdc-"))  # short: Ray's socket paths live under it
    try:
        yield shm, scratch
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)


def test_a_sigkilled_cluster_leaves_nothing_the_next_store_does_not_reclaim(places, monkeypatch):
    shm, scratch = places
    disk = {"path": str(scratch / "disk"), "capacity": 64 * SLOT, "direct_io": False}
    config = store_config(shm, 16 * SLOT, segment_size=4 * SLOT, lease_seconds=1.0, disk=disk)
    # A store of another simulated node, alive beside the doomed cluster, in the same shm_dir.
    live = NodeStore(store_config(shm, 8 * SLOT, segment_size=4 * SLOT), node_id="live-node-0000")
    try:
        epoch = live.register("engine", "live-ns", SLOT).epoch
        assert live.step(_reserve("engine", "live-ns", epoch, 4)).reserved
        live_segments = set(shm.glob("kvstrata-live-node-0*"))
        assert live_segments

        env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
        env["PYTHONPATH"] = str(REPO)
        cluster = subprocess.Popen(
            [sys.executable, "-c", _CLUSTER, json.dumps(config), str(scratch / "ray"), str(SLOT)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=env,
        )  # fmt: skip
        try:
            reported = json.loads(read_line(cluster, timeout_s=180))
        finally:
            killed = kill_every_process(cluster.pid)
            cluster.wait(timeout=30)
        assert reported["store_pid"] in killed
        dead_segments = set(shm.glob(f"kvstrata-*-{reported['epoch']}-*"))
        assert dead_segments, "the store stored no chunk in its arena"
        # The kernel drops the dead store's locks once its process is gone; its files stay.
        wait_for(lambda: all(is_locked(path) is False for path in dead_segments), 30, "the dead store's locks free")
        assert all(path.exists() for path in dead_segments)

        # The next store on the machine: its disk tier takes the directory over, its arena
        # reclaims the dead segments one lease later, and says so in its report.
        following = NodeStore(config, node_id="next-node-0000")
        try:
            assert following.disk is not None, following.disk_error
            assert following.stats()["report"]["reclaimed"]["disk_locks_taken_over"] == 1
            wait_for(lambda: following.stats()["report"]["reclaimed"]["shm_files"] == len(dead_segments), 30, "reclaim")
            reclaimed = following.stats()["report"]["reclaimed"]
            assert reclaimed["shm_bytes"] >= 6 * SLOT  # the six chunks the dead store held
            assert not any(path.exists() for path in dead_segments)
            assert all(path.exists() for path in live_segments)
        finally:
            following.close()
    finally:
        survivors = set(shm.glob("kvstrata-live-node-0*"))
        live.close()
    assert survivors == live_segments


@pytest.mark.parametrize("command,exit_code", [("down", 0), ("up", 2)])
def test_kvstrata_up_and_down_reclaim_at_once_and_spare_a_live_store(command, exit_code, places, monkeypatch, tmp_path, capsys):
    """`down` with no Ray cluster left reclaims and exits 0; `up` reclaims before it looks for a cluster."""
    shm, scratch = places
    config = store_config(shm, 8 * SLOT, segment_size=4 * SLOT)
    dead = subprocess.Popen(
        [sys.executable, "-c", _DEAD_ARENA, str(shm)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        dead_segment = Path(read_line(dead, timeout_s=60).strip())
    finally:
        dead.send_signal(signal.SIGKILL)
        dead.wait(timeout=30)
    live = NodeStore(config, node_id="live-node-0000")
    try:
        epoch = live.register("engine", "live-ns", SLOT).epoch
        assert live.step(_reserve("engine", "live-ns", epoch, 2)).reserved
        live_segments = set(shm.glob("kvstrata-live-node-0*"))
        path = tmp_path / "config.yaml"
        path.write_text(json.dumps(config))

        def no_cluster(*args, **kwargs):
            raise StoreUnavailable("kvstrata needs a running Ray cluster on this node and found none. Start one")

        # Never join whichever cluster runs on this machine: the cluster here is dead.
        monkeypatch.setattr("kvstrata.actors.client.join_cluster", no_cluster)
        assert cli.main([command, "--config", str(path)]) == exit_code
        out = capsys.readouterr().out
        assert command == "up" or "no kvstrata store to take down" in out
        assert "reclaimed 1 segment(s)" in out and "bytes freed" in out
        assert not dead_segment.exists()
        assert all(path.exists() for path in live_segments)
    finally:
        live.close()


_DEAD_ARENA = """
from kvstrata.tiers.arena import Arena
import sys
arena = Arena(sys.argv[1], "dead-node-00", capacity=4 * 65536, segment_size=2 * 65536, lease_seconds=30, prefault=False)
pool = arena.pool("dead-ns", 65536)
pool.view(pool.reserve("engine", 1)[0])[:] = 1
print(pool.geometry.segment_path(0), flush=True)
sys.stdin.read()  # lives until killed
"""


def _reserve(holder: str, namespace: str, epoch: str, count: int):
    from kvstrata.protocol import StepRequest

    return StepRequest(holder, namespace, epoch=epoch, reserve=count)
