"""What the disk admission chose to keep survives: a chunk admitted (the head of its prefix,
a chunk used again, a retained one) is on disk once the arena lets it go, and comes back
as a hit after tens of minutes idle; a one-off tail is never written. A node store in
this process, its background jobs run between the steps (issue #47, item 3)."""

from __future__ import annotations

import pytest

from kvstrata._dev.executors import ManualExecutors
from kvstrata.store.node_store import NodeStore
from kvstrata.protocol import StepRequest
from kvstrata.tiers.changelog import STORAGE
from kvstrata.tiers.disk import HEADER_BYTES
from tests.utils import FakeClock, key, layout, store_config

SLOT = 4096
HOLDER = "engine-a"


class Engine:
    """The control protocol as a manager sends it, one call per step, the jobs run after each."""

    def __init__(self, tmp_path, write_policy: str, admission: str, arena_slots: int = 4):
        self.clock = FakeClock()
        self.jobs = ManualExecutors("disk", "object", "peer")
        disk = {"path": str(tmp_path / "disk"), "capacity": 64 * (SLOT + HEADER_BYTES), "write_policy": write_policy, "direct_io": False}
        raw = store_config(tmp_path, capacity=arena_slots * SLOT, segment_size=arena_slots * SLOT, lease_seconds=7200, disk=disk)
        raw["admission"] = {"store": {"disk": admission, "min_uses": 2, "window": 4096, "head_tokens": 2 * 512}}
        self.store = NodeStore(raw, "node0", clock=self.clock, executors=self.jobs)
        self.namespace = layout(worker_bytes=SLOT).namespace
        registration = self.store.register(HOLDER, self.namespace, SLOT)
        self.epoch, self.seq = registration.epoch, registration.seq

    def step(self, run_jobs: bool = True, **fields):
        reply = self.store.step(StepRequest(HOLDER, self.namespace, epoch=self.epoch, known_seq=self.seq, **fields))
        assert not reply.rejected, reply.rejected
        self.seq = reply.seq
        if run_jobs:
            self.jobs.run_all()
        return reply

    def store_chain(self, chunks: list[tuple[bytes, int]]) -> None:
        """A request computes `chunks` (key, end token) and stores them; it then lets go."""
        slots = []
        while len(slots) < len(chunks):
            slots += self.step(reserve=len(chunks) - len(slots)).reserved
        commit = list(zip(slots, [k for k, _ in chunks]))
        self.step(commit=commit, positions=chunks, unpin=slots)

    def use(self, keys: list[bytes]) -> dict[bytes, int]:
        """A request loads `keys`: pinned at once if resident, else after promotion (RETRY)."""
        pinned, pending = {}, list(keys)
        for _ in range(6):
            reply = self.step(pin=pending)
            pinned.update(reply.pinned)
            pending = list(reply.pending)
            if not pending:
                break
        self.step(unpin=list(pinned.values()))
        return pinned

    def on_disk(self) -> set[bytes]:
        return set(self.store.keys(self.namespace, STORAGE))

    def close(self):
        self.store.close()


@pytest.fixture
def engines(tmp_path):
    made = []

    def make(*args, **kwargs):
        root = tmp_path / str(len(made))
        root.mkdir()
        made.append(Engine(root, *args, **kwargs))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def chain(start: int, blocks: int) -> list[tuple[bytes, int]]:
    return [(key(start + i), (i + 1) * 512) for i in range(blocks)]


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_the_head_of_a_prefix_survives_idle_time_and_comes_back_as_a_hit(engines, write_policy):
    engine = engines(write_policy, "chain")
    first = chain(0, 4)  # head: the first two (1,024 tokens)
    engine.store_chain(first)
    engine.store_chain(chain(100, 4))  # another request: the first one's chunks leave the arena
    head = {key(0), key(1)}
    assert head <= engine.on_disk()
    assert not {key(2), key(3)} & engine.on_disk()  # one-off tail: never written
    engine.clock.advance(25 * 60)  # the next turn comes 25 minutes later
    assert set(engine.use([key(0), key(1)])) == head
    assert engine.store.counters["disk_promotions"] >= 2


def test_a_tail_chunk_used_again_is_written_when_the_arena_lets_it_go(engines):
    engine = engines("write_back", "chain")
    engine.store_chain(chain(0, 4))
    assert set(engine.use([key(0), key(1), key(2)])) == {key(0), key(1), key(2)}  # a second turn
    engine.store_chain(chain(100, 4))
    assert {key(0), key(1), key(2)} <= engine.on_disk()
    assert key(3) not in engine.on_disk()


@pytest.mark.parametrize("admission", ["reuse", "chain"])
def test_a_retained_chunk_is_written_whatever_its_uses(engines, admission):
    """kv.retain says keep it: the arena lets it go last, and the disk below is where it
    survives. Before #47 the reuse test skipped a retained one-off at eviction: it was lost."""
    engine = engines("write_back", admission, arena_slots=4)
    tail = chain(0, 4)
    engine.store.retain(engine.namespace, [key(3)], priority=50, ttl_s=3600)
    engine.store_chain(tail)
    engine.store_chain(chain(100, 4))
    engine.store_chain(chain(200, 4))
    assert key(3) in engine.on_disk()
    assert key(2) not in engine.on_disk()  # its neighbour, not retained, is a one-off tail
    engine.clock.advance(30 * 60)
    assert set(engine.use([key(3)])) == {key(3)}


def test_a_chunk_used_again_while_its_copy_is_queued_is_written_once(engines):
    """The head is queued for disk at commit; a second turn uses it before the write lands,
    which makes it reused: the late copy for reused chunks must not write it again (CI,
    loaded machine: 5 disk writes for 4 chunks)."""
    engine = engines("write_through", "chain")
    head = chain(0, 2)
    keys = [k for k, _ in head]
    slots = []
    while len(slots) < 2:
        slots += engine.step(reserve=2 - len(slots)).reserved
    engine.step(run_jobs=False, commit=list(zip(slots, keys)), positions=head, unpin=slots)
    assert engine.jobs["disk"].pending  # the commit's copies wait in the disk queue
    reply = engine.step(run_jobs=False, pin=keys)
    assert set(reply.pinned) == set(keys)
    engine.step(unpin=list(reply.pinned.values()))  # now every queued job runs
    written = engine.store.io_meter.totals("disk", "write")
    assert written.chunks == 2 and written.bytes == 2 * SLOT
    assert set(keys) <= engine.on_disk()
