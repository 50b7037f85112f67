"""The object tier over fsspec's in-memory filesystem and a filesystem that fails on demand."""

from __future__ import annotations

import logging
import threading
import time
from datetime import datetime, timedelta, timezone

import fsspec
import numpy as np
import pytest

from kvstrata.config import ObjectTierConfig
from kvstrata.tiers.object_store import ObjectTier
from kvstrata.tiers.records import HEADER_BYTES
from tests.utils import FakeClock, key

NS = "ns-test"
SIZE = 8192


@pytest.fixture
def url(memory_bucket):
    return memory_bucket


def tier_for(url, clock=None, **overrides):
    return ObjectTier(ObjectTierConfig(url=url, **overrides), clock=clock or FakeClock())


def chunk(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, SIZE, dtype=np.uint8)


def test_chunks_round_trip_bit_exact(url):
    tier = tier_for(url)
    items = [(key(i, group=i % 3), chunk(i)) for i in range(20)]
    assert tier.put_many(NS, items) == [True] * 20
    outs = [(k, np.zeros(SIZE, np.uint8)) for k, _ in items]
    assert tier.get_many(NS, outs) == [True] * 20
    for (_, written), (_, read) in zip(items, outs):
        assert np.array_equal(written, read)
    assert tier.list_keys(NS) == {k for k, _ in items}
    tier.close()


def test_names_fan_out_on_the_hash_and_keep_the_group(url):
    tier = tier_for(url)
    path = tier.object_path(NS, key(7, group=2))
    prefix, fan, name = path.rsplit("/", 3)[-3:]
    assert prefix == NS and len(fan) == 2 and name.startswith(fan) and name.endswith("-g2")
    assert ObjectTier.key_of(path) == key(7, group=2)
    assert ObjectTier.key_of(f"{tier.root}/{NS}/manifest.json") is None
    tier.close()


def test_absent_and_corrupt_objects_are_misses_and_counted(url):
    tier = tier_for(url)
    tier.put_many(NS, [(key(1), chunk(1))])
    path = tier.object_path(NS, key(1))
    raw = bytearray(tier.fs.cat_file(path))
    raw[-5] ^= 0xFF
    tier.fs.pipe_file(path, bytes(raw))
    out = np.zeros(SIZE, np.uint8)
    assert tier.get_many(NS, [(key(1), out), (key(2), out)]) == [False, False]
    assert tier.counters["corrupt_chunks"] == 1 and tier.counters["not_found"] == 1
    # An object stored under another chunk's name is not that chunk either.
    tier.fs.pipe_file(tier.object_path(NS, key(3)), tier.fs.cat_file(tier.object_path(NS, key(1))))
    assert tier.get_many(NS, [(key(3), out)]) == [False]
    assert tier.counters["corrupt_chunks"] == 2
    tier.close()


def test_manifests_describe_namespaces_and_purge_removes_one(url):
    tier = tier_for(url)
    tier.write_manifest(NS, {"model": "tiny", "slot_bytes": SIZE})
    tier.write_manifest("other", {"model": "other"})
    tier.put_many(NS, [(key(i), chunk(i)) for i in range(3)])
    tier.put_many("other", [(key(9), chunk(9))])
    assert tier.manifests() == {NS: {"model": "tiny", "slot_bytes": SIZE}, "other": {"model": "other"}}
    assert tier.purge(NS) == 3
    assert tier.list_keys(NS) == set() and tier.list_keys("other") == {key(9)}
    tier.close()


class SwitchableFS:
    """Wraps a filesystem; while `down`, every call raises like an unreachable endpoint."""

    def __init__(self, fs):
        self.fs = fs
        self.down = False
        self.calls = 0

    def __getattr__(self, name):
        target = getattr(self.fs, name)

        def call(*args, **kwargs):
            self.calls += 1
            if self.down:
                raise ConnectionError("endpoint unreachable (secret=hunter2-credential)")
            return target(*args, **kwargs)

        return call

    @classmethod
    def install(cls, tier: ObjectTier) -> "SwitchableFS":
        """Put a switch in front of a running tier's filesystem, uploads and GETs alike."""
        switch = cls(tier.fs)
        tier.fs = tier.client.fs = switch
        return switch


def test_a_failing_store_pauses_the_tier_then_recovers(url, caplog):
    clock = FakeClock()
    config = ObjectTierConfig(url=url, storage_options={"secret": "hunter2-credential"}, backoff_max_seconds=8)
    fs, root = fsspec.core.url_to_fs(url)
    switch = SwitchableFS(fs)
    tier = ObjectTier(config, clock=clock, filesystem=(switch, root))
    switch.down = True
    with caplog.at_level(logging.INFO, logger="kvstrata.tiers.object_store"):
        assert tier.put_many(NS, [(key(i), chunk(i)) for i in range(8)]) == [False] * 8
        calls = switch.calls
        # Paused: nothing reaches the store, everything is a counted miss or drop.
        assert tier.get_many(NS, [(key(1), np.zeros(SIZE, np.uint8))]) == [False]
        assert tier.list_keys(NS) is None
        assert switch.calls == calls
        assert tier.counters["skipped_while_paused"] >= 2
        switch.down = False
        clock.advance(8)
        assert tier.put_many(NS, [(key(1), chunk(1))]) == [True]
        assert tier.available()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failed" in m for m in messages) == 1  # one line per outage, not per chunk
    assert any("answers again" in m for m in messages)
    assert all("hunter2-credential" not in m for m in messages)
    assert "hunter2-credential" not in str(tier.stats())
    tier.close()


def test_the_pause_grows_while_the_store_keeps_failing(url):
    clock = FakeClock()
    fs, root = fsspec.core.url_to_fs(url)
    switch = SwitchableFS(fs)
    tier = ObjectTier(ObjectTierConfig(url=url, backoff_max_seconds=4), clock=clock, filesystem=(switch, root))
    switch.down = True
    pauses = []
    for _ in range(5):
        tier.put_many(NS, [(key(1), chunk(1))])
        pauses.append(tier._paused_until - clock.now)
        clock.advance(pauses[-1])
    assert pauses[-1] <= 4 and max(pauses) > pauses[0]
    tier.close()


def test_pyarrow_gets_serve_s3_urls_only(url):
    assert tier_for(url).client.name == "fsspec"
    with pytest.raises(ValueError, match="tiers.object.client: pyarrow serves s3:// URLs only, not memory://"):
        tier_for(url, client="pyarrow")


def test_s3_options_translate_to_pyarrow_or_say_why_not(monkeypatch):
    from kvstrata.tiers.object_clients import pyarrow_s3_options

    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    options = pyarrow_s3_options(
        ObjectTierConfig(
            url="s3://bucket/kv",
            endpoint_url="http://127.0.0.1:9000",
            storage_options={"key": "id", "secret": "sk", "config_kwargs": {"read_timeout": 9}},
            timeouts={"connect_seconds": 3, "read_seconds": 4},
        )
    )
    assert {k: options[k] for k in ("access_key", "secret_key", "endpoint_override", "scheme")} == {
        "access_key": "id", "secret_key": "sk", "endpoint_override": "127.0.0.1:9000", "scheme": "http"
    }  # fmt: skip
    assert (options["connect_timeout"], options["request_timeout"]) == (3, 9)  # botocore setting wins, as in s3fs
    no_region = pyarrow_s3_options(ObjectTierConfig(url="s3://bucket/kv"))
    assert no_region.startswith("neither endpoint_url nor a region")
    with_region = pyarrow_s3_options(ObjectTierConfig(url="s3://b/kv", storage_options={"client_kwargs": {"region_name": "eu-west-1"}}))
    assert with_region["region"] == "eu-west-1" and "endpoint_override" not in with_region


def written(tier, namespace, k, when: datetime) -> None:
    """Backdate an object of the memory:// store (its listing reports `created`)."""
    tier.fs.store[tier.object_path(namespace, k)].created = when


def test_a_sweep_deletes_the_oldest_written_objects_beyond_capacity(url):
    record = HEADER_BYTES + SIZE
    tier = tier_for(url, capacity=3 * record)
    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    tier.put_many(NS, [(key(i), chunk(i)) for i in range(3)])
    tier.put_many("other", [(key(i), chunk(i)) for i in range(3, 5)])
    for age, (namespace, i) in enumerate([(NS, 0), ("other", 3), (NS, 1), (NS, 2), ("other", 4)]):
        written(tier, namespace, key(i), base + timedelta(minutes=age))
    kept = tier.apply_limits(tier.scan())
    # The capacity covers the whole URL, every namespace: the two oldest writes go.
    assert {(e.namespace, e.key) for e in kept} == {(NS, key(1)), (NS, key(2)), ("other", key(4))}
    assert tier.list_keys(NS) == {key(1), key(2)} and tier.list_keys("other") == {key(4)}
    assert tier.counters["evicted"] == 2 and tier.counters["expired"] == 0
    assert tier.apply_limits(tier.scan()) == kept  # within capacity: nothing more goes
    tier.close()


def test_a_sweep_that_deletes_a_full_attention_chunk_takes_its_window_and_state(url):
    record = HEADER_BYTES + SIZE
    tier = tier_for(url, capacity=3 * record)
    tier.set_anchor_groups(NS, [0])
    base = datetime(2026, 1, 1, tzinfo=timezone.utc)
    position = [key(0, group=g) for g in (0, 1, 2)]  # one position: full, window, state
    later = [key(1), key(2)]
    tier.put_many(NS, [(k, chunk(i)) for i, k in enumerate(position + later)])
    for age, k in enumerate([position[0], *later, position[1], position[2]]):  # the anchor is the oldest
        written(tier, NS, k, base + timedelta(minutes=age))
    kept = tier.apply_limits(tier.scan())
    # Over capacity by two: the anchor goes first, and its window and state with it.
    assert {e.key for e in kept} == set(later)
    assert tier.list_keys(NS) == set(later)
    assert tier.counters["evicted"] == 1 and tier.counters["evicted_with_anchor"] == 2
    tier.close()


def test_a_sweep_deletes_objects_older_than_the_ttl(url):
    now = datetime(2026, 6, 1, tzinfo=timezone.utc)
    tier = ObjectTier(ObjectTierConfig(url=url, ttl_seconds=3600), clock=FakeClock(), wall_clock=now.timestamp)
    tier.put_many(NS, [(key(i), chunk(i)) for i in range(3)])
    written(tier, NS, key(0), now - timedelta(hours=2))
    written(tier, NS, key(1), now - timedelta(minutes=59))
    written(tier, NS, key(2), now - timedelta(days=9))
    kept = tier.apply_limits(tier.scan())
    assert [e.key for e in kept] == [key(1)] and tier.list_keys(NS) == {key(1)}
    assert tier.counters["expired"] == 2
    tier.close()


def test_a_sweep_that_cannot_delete_keeps_its_entries_and_pauses(url):
    fs, root = fsspec.core.url_to_fs(url)
    switch = SwitchableFS(fs)
    tier = ObjectTier(ObjectTierConfig(url=url, ttl_seconds=1), clock=FakeClock(), filesystem=(switch, root),
                      wall_clock=lambda: 4e9)  # fmt: skip
    tier.put_many(NS, [(key(1), chunk(1))])
    entries = tier.scan()
    switch.down = True
    assert tier.apply_limits(entries) == entries and not tier.available()
    switch.down = False
    assert tier.list_keys(NS) is None  # paused, not answered wrongly
    tier.close()


class StuckClient:
    """A chunk client whose calls hang until released (a request that outlives its deadline)."""

    name = "stuck"

    def __init__(self, client):
        self.inner = client
        self.fs = client.fs
        self.release = threading.Event()
        self.started = threading.Event()

    def put(self, path, body):
        self.started.set()
        assert self.release.wait(30)
        self.inner.put(path, body)

    def get(self, path, expected_bytes):
        self.started.set()
        assert self.release.wait(30)
        return self.inner.get(path, expected_bytes)


FAST_DEADLINE = {"timeouts": {"connect_seconds": 0.05, "read_seconds": 0.05}, "max_attempts": 1}


def test_a_get_past_its_deadline_is_a_miss_and_never_writes_its_buffer_later(url):
    tier = tier_for(url, **FAST_DEADLINE)
    tier.put_many(NS, [(key(1), chunk(1))])
    stuck = tier.client = StuckClient(tier.client)
    out = np.zeros(SIZE, np.uint8)
    started = time.monotonic()
    assert tier.get_many(NS, [(key(1), out)]) == [False]
    assert time.monotonic() - started < tier.request_deadline + 1
    assert tier.counters["get_failures"] == 1 and not tier.available()
    stuck.release.set()
    tier.close()  # waits for the stuck request to finish
    assert not out.any()  # the slot may belong to another chunk by now: untouched


def test_a_put_past_its_deadline_uploads_only_what_it_was_given(url):
    tier = tier_for(url, **FAST_DEADLINE)
    stuck = tier.client = StuckClient(tier.client)
    payload = chunk(2).copy()
    assert tier.put_many(NS, [(key(2), payload)]) == [False]
    assert stuck.started.is_set() and tier.counters["put_failures"] == 1
    payload[:] = 0  # the caller reuses its slot at once
    stuck.release.set()
    tier.close()
    late = tier_for(url)  # the late upload landed: with the bytes it was given, verified
    out = np.zeros(SIZE, np.uint8)
    assert late.get_many(NS, [(key(2), out)]) == [True] and np.array_equal(out, chunk(2))
    late.close()
