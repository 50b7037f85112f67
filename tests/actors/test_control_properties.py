"""Property tests (hypothesis) of the store's control surface: whatever an engine sends --
random or adversarial namespaces, holder names, slot sizes, slot indices, keys, purges --
each call either works or is a ValueError that names the bad value; no other exception,
and the chunks of namespaces it did not name are never deleted (issue #29). In-process
store (no Ray), arena and disk tier."""

from __future__ import annotations

import string

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.config import load_config
from kvstrata.tiers.changelog import CPU, STORAGE
from kvstrata.tiers.disk import HEADER_BYTES
from tests.utils import key, store_config

SLOT = 4096
PROTECTED = ("tenant-a-ns", "tenant-b-ns")
ADVERSARIAL_NAMES = [
    "", ".", "..", "../x", "/", "a/b", "/a", "a/", "tenant-a", "tenant-a-ns-x", "tenant-a-ns/..", "tenant-a-ns/",
    "../tenant-a-ns", ".tenant-a-ns", "tenant-a-ns\x00", "kvstrata:cascade", "kvstrata:upload", "kvstrata:promote",
    "x" * 129, "x" * 201, " ", "é", "*", "tenant-?-ns",
]  # fmt: skip
names = st.one_of(
    st.sampled_from(ADVERSARIAL_NAMES),
    st.text(max_size=24),
    st.text(alphabet=string.ascii_letters + string.digits + "-_.", min_size=1, max_size=24),
).filter(lambda name: name not in PROTECTED)  # naming a namespace is what lets a call purge it
sizes = st.one_of(st.sampled_from([SLOT, 2 * SLOT, 0, -1, 1 << 62]), st.integers(-(1 << 70), 1 << 70))
keys = st.one_of(st.binary(max_size=40), st.builds(key, st.integers(0, 20)))
slot_numbers = st.integers(-(1 << 40), 1 << 40)



def calls(names: st.SearchStrategy[str]) -> st.SearchStrategy[tuple]:
    """One control call whose names come from `names` (a few per example, so calls share them)."""
    return st.one_of(
        st.tuples(st.just("register"), names, names, sizes, st.one_of(st.none(), st.builds(dict, namespace_prefix=names))),
        st.tuples(
            st.just("step"),
            st.builds(
                StepRequest,
                holder=names,
                namespace=names,
                pin=st.lists(keys, max_size=4),
                hold=st.lists(st.tuples(keys, slot_numbers), max_size=3),
                unpin=st.lists(slot_numbers, max_size=3),
                commit=st.lists(st.tuples(slot_numbers, keys), max_size=3),
                release=st.lists(slot_numbers, max_size=3),
                reserve=st.integers(-5, 40),
                purge=st.booleans(),
            ),
        ),
        st.tuples(st.just("export_chunks"), names, st.lists(keys, max_size=4)),
        st.tuples(st.just("release_holder"), names, names),
        st.tuples(st.just("purge"), names),
        st.tuples(st.just("keys"), names),
    )


def named_in(message: str, values: list[object]) -> bool:
    return any(repr(value)[:40] in message for value in values)


@pytest.fixture
def store(tmp_path):
    disk = {"path": str(tmp_path / "disk"), "capacity": 4096 * (SLOT + HEADER_BYTES), "write_policy": "write_through"}
    raw = store_config(tmp_path, capacity=64 * SLOT, disk=disk)
    raw["tiers"]["object"] = {"url": f"file://{tmp_path}/bucket/kv", "write_policy": "write_through"}
    node_store = NodeStore(load_config(raw), "node0")
    owner_epoch = ""
    for n, namespace in enumerate(PROTECTED):
        epoch = node_store.register("owner", namespace, SLOT, epoch=owner_epoch).epoch
        owner_epoch = epoch
        pool = node_store.arena.pools[namespace]
        slots = pool.reserve("owner", 4)
        for slot in slots:
            pool.view(slot)[:] = np.random.default_rng(slot).integers(0, 256, SLOT, dtype=np.uint8)
        node_store.step(StepRequest("owner", namespace, epoch=epoch, commit=[(slot, key(10 * n + i)) for i, slot in enumerate(slots)]))
    assert node_store.wait_io(30)
    yield node_store
    node_store.close()


def held(store: NodeStore, namespace: str) -> dict[str, set[bytes]]:
    """What each tier holds of a namespace: the arena and the disk (whose chunks
    eviction may move but never drop: write-through) as one, the bucket on its own."""
    return {
        "arena or disk": set(store.keys(namespace, CPU)) | set(store.keys(namespace, STORAGE)),
        "bucket": store.object.list_keys(namespace),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_control_call_works_or_names_its_bad_value_and_never_deletes_another_namespace(store, data):
    few_names = data.draw(st.lists(names, min_size=1, max_size=3, unique=True))
    sequence = data.draw(st.lists(calls(st.sampled_from(few_names)), min_size=1, max_size=8))
    before = {namespace: held(store, namespace) for namespace in PROTECTED}
    assert all(len(chunks) == 4 for tiers in before.values() for chunks in tiers.values())
    for name, *args in sequence:
        values = list(args) if name != "step" else [args[0].holder, args[0].namespace]
        values += [value for arg in args if isinstance(arg, dict) for value in arg.values()]
        if name == "step" and data.draw(st.booleans()):
            # Half the steps come from the holder's own engine (its epoch, adversarial
            # content); the rest are refused for their epoch alone.
            args[0].epoch = store._holders.get(args[0].holder, "")
        try:
            getattr(store, name)(*args)
        except ValueError as exc:
            assert named_in(str(exc), values), f"{name}{tuple(args)!r}: {exc}"
    assert store.wait_io(30)
    assert {namespace: held(store, namespace) for namespace in PROTECTED} == before
