"""`kvstrata up` exits non-zero naming what failed: a tier that cannot work, or a store
that did not start at all (its constructor raised), which --allow-degraded does not
accept. Ray-free: the store handle and `ray.get` are stand-ins; the Ray path is covered
in tests/actors/test_operability.py."""

from __future__ import annotations

import ray
from rich.console import Console

import kvstrata.actors.client as client
from kvstrata.cli import _up
from kvstrata.config import load_config


class Handle:
    """A store actor handle whose `stats.remote()` is the answer `ray.get` will give."""

    def __init__(self, answer):
        self.stats = self
        self.answer = answer

    def remote(self):
        return self


def fake_get(handle, timeout=None):
    if isinstance(handle.answer, Exception):
        raise handle.answer
    return handle.answer


def stats(disk_state="ok", reason="", damaged=0):
    return {
        "node_id": "node0", "pid": 1, "epoch": "e",
        "disk": {"damaged_files": damaged},
        "report": {"tiers": {"disk": {"state": disk_state, "reason": reason}}},
    }  # fmt: skip


def run_up(monkeypatch, tmp_path, answer, allow_degraded=False):
    monkeypatch.setattr(client, "ensure_node_store", lambda config: Handle(answer))
    monkeypatch.setattr(ray, "get", fake_get)
    config = load_config({"tiers": {"cpu": {"shm_dir": str(tmp_path)}, "disk": {"path": str(tmp_path / "d"), "capacity": "1MiB"}}})
    console = Console(record=True, width=200)
    code = _up(config, console, allow_degraded)
    return code, console.export_text()


def test_a_store_whose_constructor_raised_is_named_and_up_exits_1_even_when_degraded_is_allowed(monkeypatch, tmp_path):
    for allow in (False, True):
        code, out = run_up(monkeypatch, tmp_path, RuntimeError("creation task failed\nZeroDivisionError: integer division"), allow)
        assert code == 1
        assert "FAILED node store on this node did not start: ZeroDivisionError: integer division" in out
        assert "1 node store(s) did not start" in out


def test_a_disk_tier_that_cannot_work_is_named_and_up_exits_1(monkeypatch, tmp_path):
    code, out = run_up(monkeypatch, tmp_path, stats("error", "tiers.disk.path: /proc/x is not a writable directory"))
    assert code == 1
    failed = [line for line in out.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "/proc/x is not a writable directory" in failed[0]
    assert run_up(monkeypatch, tmp_path, stats("error", "x"), allow_degraded=True)[0] == 0


def test_a_healthy_store_exits_0_and_mentions_damaged_files_set_aside(monkeypatch, tmp_path):
    code, out = run_up(monkeypatch, tmp_path, stats(damaged=3))
    assert code == 0 and "FAILED" not in out
    assert "3 damaged file(s) set aside into damaged/" in out
