"""Issue #37, finding 8: the security leftovers, one test each.

1. The holder token (the secret half of a registration's epoch) is not logged when an
   engine registers again.
2. Credentials inside the object `url` (`s3://user:pass@host/...`) show in no log line,
   error, `kvstrata status` (tables or `--json`) nor the store actor's arguments.
3. A registration whose layout does not digest to the namespace it names (another
   `namespace_prefix`: another tenant's quota) or whose `anchor_groups` contradict it is
   refused, before anything changes.
4. A namespace hashed with a non-cryptographic block hash is said so at start (one line)
   and stays on its node: never uploaded to the object store nor promoted from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging

import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from rich.console import Console

from kvstrata.actors import secrets as secrets_module
from kvstrata._dev.executors import ManualExecutors
from kvstrata.store.node_store import LocalStoreClient, NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.cli.status_view import render_status
from kvstrata.config import ObjectTierConfig, load_config
from kvstrata.connector.manager import StrataManager
from kvstrata.tiers import object_store
from kvstrata.tiers.changelog import OBJECT
from kvstrata.tiers.object_store import ObjectTier
from tests.connector.harness import step
from tests.utils import FakeClock, key, layout, store_config

SLOT = 4096
USER = "AKIAPLANTEDUSER0001"
PASSWORD = "planted%2Fpass%2Bword%21"  # as written in the URL (an S3 secret key's "/" and "+" encoded)
DECODED = "planted/pass+word!"


def test_the_holder_token_is_not_logged_when_an_engine_registers_again(tmp_path, caplog):
    clock = FakeClock()
    cfg = store_config(tmp_path, capacity=16 * SLOT)
    client = LocalStoreClient(NodeStore(cfg, "node0", clock=clock))
    manager = StrataManager(client, layout(worker_bytes=SLOT), load_config(cfg), "engine-a", clock=clock)
    try:
        assert manager.wait_idle(10)
        client.store.close()
        client.store = NodeStore(cfg, "node0", clock=clock)  # a restarted store: the engine registers again
        with caplog.at_level(logging.INFO):
            step(manager)
            step(manager)
        token = client.store._holders["engine-a"].partition(".")[2]
        assert "node store restarted" in caplog.text  # the line that showed it
        assert len(token) >= 16 and token not in caplog.text
    finally:
        manager.shutdown()
        client.store.close()


class QuotingFileSystem(MemoryFileSystem):
    """A client library that quotes the URL it was given (credentials and all) in its errors."""

    url = ""

    def pipe_file(self, path, value, **kwargs):
        raise PermissionError(f"access denied for {self.url} ({DECODED})")


def test_credentials_in_the_object_url_show_nowhere(tmp_path, caplog, monkeypatch):
    url = f"memory://{USER}:{PASSWORD}@bucket/kv"
    fs = QuotingFileSystem(skip_instance_cache=True)
    fs.url = url
    monkeypatch.setattr(object_store, "open_filesystem", lambda config: (fs, "bucket/kv"))
    cfg = store_config(tmp_path, capacity=16 * SLOT)
    cfg["tiers"]["object"] = {"url": url, "client": "fsspec", "max_attempts": 1, "write_policy": "write_through"}
    with caplog.at_level(logging.DEBUG):
        store = NodeStore(cfg, "node0")
        try:
            epoch = store.register("engine-a", "ns", SLOT).epoch
            pool = store.arena.pools["ns"]
            [slot] = pool.reserve("engine-a", 1)
            store.step(StepRequest("engine-a", "ns", epoch=epoch, commit=[(slot, key(1))]))
            assert store.wait_io(10)
            stats = store.stats()
            probe = store.object.probe("secret-test")
        finally:
            store.close()
    console = Console(record=True, width=200)
    console.print(render_status([stats]))
    outputs = {
        "log": caplog.text,
        "status --json": json.dumps(stats, default=str),
        "status": console.export_text(),
        "probe": str(probe),
    }
    assert "access denied" in outputs["probe"] and "bucket/kv" in outputs["status --json"]  # what is no secret shows
    leaks = {name: [s for s in (USER, PASSWORD, DECODED) if s in text] for name, text in outputs.items()}
    assert not any(leaks.values()), leaks


class FakeClusterKV:
    """The Ray cluster's key-value store, as `actors/secrets.py` uses it (no cluster needed)."""

    def __init__(self) -> None:
        self.entries: dict[str, bytes] = {}

    def put(self, name, value, overwrite=True, namespace=None):
        if overwrite or name not in self.entries:
            self.entries[name] = value.encode() if isinstance(value, str) else value
        return True

    def get(self, name, namespace=None):
        return self.entries.get(name)


def test_credentials_in_the_object_url_stay_out_of_the_store_actors_arguments(monkeypatch):
    from ray.experimental import internal_kv

    kv = FakeClusterKV()
    monkeypatch.setattr(internal_kv, "_internal_kv_put", kv.put)
    monkeypatch.setattr(internal_kv, "_internal_kv_get", kv.get)
    url = f"s3://{USER}:{PASSWORD}@bucket/kv"
    config = load_config({"tiers": {"object": {"url": url, "storage_options": {"secret": "planted-secret-key"}}}})
    arguments = secrets_module.stash_secrets(config)
    assert USER not in json.dumps(arguments) and PASSWORD not in json.dumps(arguments)
    load_config(arguments)  # still a config (the reconciler loads it)
    assert secrets_module.stash_secrets(load_config(arguments)) == arguments  # stashing again changes nothing
    resolved = secrets_module.resolve_secrets(arguments)
    assert resolved["tiers"]["object"]["url"] == url
    assert resolved["tiers"]["object"]["storage_options"]["secret"] == "planted-secret-key"


@pytest.fixture
def store(tmp_path):
    made = NodeStore(store_config(tmp_path, capacity=16 * SLOT), "node0")
    yield made
    made.close()


def test_a_layout_that_is_not_the_namespaces_is_refused(store):
    tenant_a = layout(worker_bytes=SLOT, prefix="tenant-a")
    namespace = tenant_a.namespace
    described = tenant_a.describe()
    # A buggy engine names tenant-a's namespace with tenant-b's prefix: another tenant's quota.
    moved = {**described, "namespace_prefix": "tenant-b"}
    with pytest.raises(ValueError, match=f"{namespace}.*tenant-b"):
        store.register("engine-b", namespace, SLOT, moved)
    assert namespace not in store.arena.pools and namespace not in store.layouts  # nothing changed
    with pytest.raises(ValueError, match=f"{namespace}.*is that of namespace"):
        store.register("engine-b", namespace, SLOT, {"namespace_prefix": "tenant-a"})  # a layout in part
    # Anchor groups are outside the digest: they must be among its groups, and agree.
    with pytest.raises(ValueError, match=r"anchor_groups \[7\]"):
        store.register("engine-b", namespace, SLOT, {**described, "anchor_groups": (7,)})
    store.register("engine-a", namespace, SLOT, {**described, "anchor_groups": (0,)})
    assert store.arena.quotas.tenant(namespace) == "tenant-a"
    two_groups = dataclasses.replace(tenant_a, group_ids=(0, 1), tokens_per_block=(32, 32))
    store.register("engine-c", two_groups.namespace, SLOT, {**two_groups.describe(), "anchor_groups": (0,)})
    with pytest.raises(ValueError, match=r"anchor_groups \[1\], where its engines said \[0\]"):
        store.register("engine-d", two_groups.namespace, SLOT, {**two_groups.describe(), "anchor_groups": (1,)})


def test_a_namespace_with_a_non_cryptographic_hash_stays_on_its_node(tmp_path, caplog):
    cfg = store_config(tmp_path, capacity=16 * SLOT)
    cfg["tiers"]["object"] = {"url": f"file://{tmp_path}/bucket/kv", "write_policy": "write_through"}
    executors = ManualExecutors("object")
    store = NodeStore(cfg, "node0", executors=executors)
    fast = dataclasses.replace(layout(worker_bytes=SLOT), hash_algo="xxhash")
    safe = layout(worker_bytes=SLOT)
    try:
        with caplog.at_level(logging.INFO):
            for holder in ("engine-a", "engine-b"):  # said once, at the namespace's first registration
                store.register(holder, fast.namespace, SLOT, fast.describe())
        said = [r.getMessage() for r in caplog.records if "not collision resistant" in r.getMessage()]
        assert len(said) == 1 and "xxhash" in said[0]
        other_node = ObjectTier(ObjectTierConfig(url=f"file://{tmp_path}/bucket/kv"))
        other_node.put_many(fast.namespace, [(key(9), np.full(SLOT, 9, dtype=np.uint8))])  # as if another node uploaded it
        other_node.close()
        epochs = {}
        for lay in (fast, safe):
            holder = f"engine-{lay.hash_algo}"
            epoch = epochs[lay.hash_algo] = store.register(holder, lay.namespace, SLOT, lay.describe()).epoch
            pool = store.arena.pools[lay.namespace]
            [slot] = pool.reserve(holder, 1)
            store.step(StepRequest(holder, lay.namespace, epoch=epoch, commit=[(slot, key(1))]))
        executors.run_all()
        assert store.object.list_keys(safe.namespace) == {key(1)}  # a sha256 namespace is shared
        assert store.object.list_keys(fast.namespace) == {key(9)}  # nothing of this node's went up
        assert key(9) in store.keys(fast.namespace, OBJECT)  # the sweep saw it, and yet:
        reply = store.step(StepRequest("engine-xxhash", fast.namespace, epoch=epochs["xxhash"], pin=[key(9)]))
        assert reply.missing == [key(9)] and not reply.pending  # never promoted from the bucket
    finally:
        executors.run_all()
        store.close()
