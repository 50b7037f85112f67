"""The disk tier alone: exact bytes, restart, checksums, torn writes, capacity, disk errors."""

from __future__ import annotations

import logging
import mmap
import os
import resource
import signal
import threading

import numpy as np
import pytest

from kvstrata.tiers import disk as disk_module
from kvstrata.tiers.disk import HEADER_BYTES, DiskTier, DiskTierError
from kvstrata.tiers.disk import index as disk_index
from kvstrata.tiers.disk import reads as disk_reads
from kvstrata.tiers.disk import slab as disk_slab
from kvstrata.tiers.disk import writes as disk_writes
from tests.utils import key, reuse_estimate

CHUNK = 16384
NS = "ns0"


def chunk(seed: int, size: int = CHUNK) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def page_aligned_chunk(seed: int) -> np.ndarray:
    """A chunk in page-aligned memory, as arena slots are: O_DIRECT writes it without staging."""
    aligned = np.frombuffer(mmap.mmap(-1, CHUNK), dtype=np.uint8)
    aligned[:] = chunk(seed)
    return aligned


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def direct_io(request):
    return request.param


@pytest.fixture
def tiers():
    made: list[DiskTier] = []
    yield made
    for tier in made:
        tier.close()


def open_tier(tiers, path, capacity=64 * CHUNK, **kwargs) -> DiskTier:
    tier = DiskTier(path, capacity, **kwargs)
    tiers.append(tier)
    return tier


def test_round_trip_is_bit_exact(tmp_path, tiers, direct_io):
    tier = open_tier(tiers, tmp_path, direct_io=direct_io)
    for i in range(5):
        assert tier.write(NS, key(i, group=i % 2), chunk(i))
    for i in range(5):
        out = np.zeros(CHUNK, dtype=np.uint8)
        assert tier.read_into(NS, key(i, group=i % 2), out)
        assert np.array_equal(out, chunk(i))
    assert not tier.read_into(NS, key(99), np.zeros(CHUNK, dtype=np.uint8))


def test_unaligned_sizes_round_trip(tmp_path, tiers, direct_io):
    tier = open_tier(tiers, tmp_path, direct_io=direct_io)
    data = chunk(7, size=10_000)
    assert tier.write(NS, key(1), data)
    out = np.zeros(10_000, dtype=np.uint8)
    assert tier.read_into(NS, key(1), out)
    assert np.array_equal(out, data)


def test_a_restarted_tier_serves_what_is_on_disk(tmp_path, tiers, direct_io):
    first = open_tier(tiers, tmp_path, direct_io=direct_io)
    for i in range(4):
        first.write(NS, key(i), chunk(i))
    first.close()  # the store died; nothing but the files survives
    second = open_tier(tiers, tmp_path, direct_io=direct_io)
    assert sorted(second.keys(NS)) == sorted(key(i) for i in range(4))
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert second.read_into(NS, key(2), out) and np.array_equal(out, chunk(2))
    size = disk_bytes(tmp_path)
    assert second.write(NS, key(10), chunk(10))  # and keeps admitting, into records it reserved
    assert disk_bytes(tmp_path) == size == second.stats()["allocated"] <= 64 * CHUNK


def file_kind(fd: int) -> str:
    """"payloads" or "headers": which of a slab's files `fd` is."""
    return os.readlink(f"/proc/self/fd/{fd}").rpartition(".")[2]


def call_sizes(monkeypatch, name: str, kind: str | None = "payloads") -> list:
    """Bytes each os.<name> (preadv or pwritev) call moves from now on, on the slab files of
    `kind` ("payloads" or "headers"), or (kind, bytes) of every call with `kind=None`."""
    sizes: list = []
    real = getattr(os, name)

    def counted(fd, buffers, offset):
        size = sum(memoryview(b).nbytes for b in buffers)
        if kind is None:
            sizes.append((file_kind(fd), size))
        elif file_kind(fd) == kind:
            sizes.append(size)
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, name, counted)
    return sizes


def payload_file(tmp_path):
    (path,) = tmp_path.glob("*.payloads")
    return path


def header_file(tmp_path):
    (path,) = tmp_path.glob("*.headers")
    return path


def disk_bytes(tmp_path) -> int:
    """What the tier's files take on disk, payloads and headers."""
    return sum(p.stat().st_size for p in [*tmp_path.glob("*.payloads"), *tmp_path.glob("*.headers")])


def test_a_flipped_byte_is_a_miss_a_counter_and_a_quarantine(tmp_path, tiers):
    tier = open_tier(tiers, tmp_path)
    tier.write(NS, key(1), chunk(1))
    tier.write(NS, key(2), chunk(2))
    with open(payload_file(tmp_path), "r+b") as f:
        f.seek(100)  # inside the first record's payload
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0x01]))
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert not tier.read_into(NS, key(1), out)
    assert tier.stats()["corrupt_chunks"] == 1
    assert not tier.contains(NS, key(1))
    assert tier.read_into(NS, key(2), out) and np.array_equal(out, chunk(2))


def test_a_torn_write_is_never_served_even_after_restart(tmp_path, tiers):
    tier = open_tier(tiers, tmp_path, direct_io=False)
    for i in (1, 3, 4):
        tier.write(NS, key(i), chunk(i))
    tier.remove(NS, key(3))  # record 1 is free again ...
    tier.close()
    # ... and a power cut hits while key(2) is being written there: its header reached the
    # disk, half its payload (written first, not yet flushed) did not: the rest is key(3)'s.
    donor = open_tier(tiers, tmp_path / "donor", direct_io=False)
    donor.write(NS, key(2), chunk(2))
    donor.close()
    with open(header_file(tmp_path), "r+b") as f:
        f.seek(HEADER_BYTES)
        f.write(header_file(tmp_path / "donor").read_bytes()[:HEADER_BYTES])
    with open(payload_file(tmp_path), "r+b") as f:
        f.seek(CHUNK)
        f.write(payload_file(tmp_path / "donor").read_bytes()[: CHUNK // 2])
    tier = open_tier(tiers, tmp_path, direct_io=False)
    assert tier.contains(NS, key(2))  # the header looks fine ...
    assert not tier.read_into(NS, key(2), np.zeros(CHUNK, dtype=np.uint8))  # ... the digest does not
    assert tier.stats()["corrupt_chunks"] == 1
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert tier.read_into(NS, key(4), out) and np.array_equal(out, chunk(4))


def test_every_index_change_is_announced_while_the_index_is_locked(tmp_path, tiers):
    """Announcements reach the store's change log in the order of the changes: one made
    after the lock was let go could land after a later eviction's, listing a chunk the disk
    no longer holds."""
    announced: list[tuple[bool, bool]] = []  # (present, lock held)
    tier = open_tier(
        tiers, tmp_path, capacity=2 * (CHUNK + HEADER_BYTES),
        on_change=lambda ns, keys, present: announced.append((present, tier._lock.locked())),
    )  # fmt: skip
    tier.write(NS, key(1), chunk(1))
    tier.write(NS, key(2), chunk(2))
    tier.write(NS, key(3), chunk(3))  # evicts key 1
    with open(payload_file(tmp_path), "r+b") as f:  # key 3 took key 1's record, the first
        f.seek(100)
        f.write(b"\xff\x00")
    assert not tier.read_into(NS, key(3), np.zeros(CHUNK, dtype=np.uint8))  # corrupt: dropped
    assert tier.remove(NS, key(2))
    assert [present for present, _ in announced] == [True, True, False, True, False, False]
    assert all(held for _, held in announced)


def test_capacity_holds_and_lru_chunks_go_first(tmp_path, tiers):
    capacity = 8 * (HEADER_BYTES + CHUNK)
    removed = []
    tier = open_tier(tiers, tmp_path, capacity=capacity, on_change=lambda ns, keys, present: present or removed.extend(keys))
    for i in range(24):  # three times the capacity
        assert tier.write(NS, key(i), chunk(i))
        if i == 4:
            tier.read_into(NS, key(0), np.zeros(CHUNK, dtype=np.uint8))  # key(0) recently used
    on_disk = sum(p.stat().st_size for p in tmp_path.iterdir() if p.name != ".kvstrata.lock")  # records, not the lock file
    assert on_disk <= capacity
    assert tier.stats()["allocated"] <= capacity
    assert not tier.contains(NS, key(1)) and tier.contains(NS, key(23))
    assert len(removed) == 16 and key(1) in removed
    assert not tier.read_into(NS, key(1), np.zeros(CHUNK, dtype=np.uint8))


def test_a_batch_takes_free_records_then_new_ones_then_evicts_only_the_shortfall_oldest_first(tmp_path, tiers):
    record = HEADER_BYTES + CHUNK
    removed = []
    tier = open_tier(tiers, tmp_path, capacity=6 * record, on_change=lambda ns, keys, present: present or removed.extend(keys))
    assert tier.write_many(NS, [(key(i), chunk(i)) for i in range(4)]) == [True] * 4
    assert tier.remove(NS, key(1))  # one free record, two never used
    removed.clear()
    batch = [(key(i), chunk(i)) for i in range(10, 15)] + [(key(0), chunk(0))]  # key(0): already there
    assert tier.write_many(NS, batch) == [True] * 6
    # 1 free + 2 never used + 2 evicted: key(0) was the oldest, but this batch asked for it again.
    assert removed == [key(2), key(3)]
    stats = tier.stats()
    assert stats["evicted"] == 2 and stats["allocated"] <= 6 * record
    assert sorted(tier.keys(NS)) == sorted([key(0)] + [key(i) for i in range(10, 15)])
    out = np.zeros(CHUNK, dtype=np.uint8)
    for i in [0, *range(10, 15)]:
        assert tier.read_into(NS, key(i), out) and np.array_equal(out, chunk(i)), i


def test_disk_full_pauses_admission_keeps_reads_and_comes_back(tmp_path, tiers, monkeypatch):
    from types import SimpleNamespace

    from kvstrata.tiers.disk import tier as tier_module

    now = [1000.0]
    monkeypatch.setattr(tier_module, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(disk_index, "GROW_MIN_BYTES", HEADER_BYTES + CHUNK)  # grow one record at a time
    tier = open_tier(tiers, tmp_path, capacity=1 << 30, direct_io=False)
    assert tier.write(NS, key(0), chunk(0))
    limit = os.path.getsize(payload_file(tmp_path)) + CHUNK // 2  # room for less than one more payload
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old_limit[1]))
        assert not tier.write(NS, key(1), chunk(1))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    stats = tier.stats()
    assert stats["write_errors"] == 1 and stats["admitting"] is False
    assert not tier.write(NS, key(2), chunk(2))  # paused: not even attempted
    assert tier.stats()["dropped_not_admitting"] == 1
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert tier.read_into(NS, key(0), out) and np.array_equal(out, chunk(0))
    now[0] += 1.0  # the first retry is a second after the failure; the disk has room again
    assert tier.write(NS, key(2), chunk(2))
    stats = tier.stats()
    assert stats["admitting"] is True and stats["write_recoveries"] == 1 and stats["write_errors"] == 1
    assert tier.read_into(NS, key(2), out) and np.array_equal(out, chunk(2))


def test_unwritable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(DiskTierError, match=f"tiers.disk.path: {blocker / 'sub'} is not a writable directory"):
        DiskTier(blocker / "sub", capacity=1 << 20)
    with pytest.raises(DiskTierError, match="capacity must be positive"):
        DiskTier(tmp_path, capacity=0)


def test_removed_chunks_stay_removed_after_restart(tmp_path, tiers, direct_io):
    tier = open_tier(tiers, tmp_path, direct_io=direct_io)
    tier.write(NS, key(1), chunk(1))
    tier.write(NS, key(2), chunk(2))
    assert tier.remove(NS, key(1))
    tier.close()
    again = open_tier(tiers, tmp_path, direct_io=direct_io)
    assert again.keys(NS) == [key(2)]


def test_one_store_per_directory(tmp_path, tiers):
    open_tier(tiers, tmp_path)
    with pytest.raises(DiskTierError, match="in use by another kvstrata store"):
        DiskTier(tmp_path, capacity=1 << 20)


def test_namespaces_never_mix(tmp_path, tiers):
    tier = open_tier(tiers, tmp_path)
    tier.write("model-a", key(1), chunk(1))
    assert not tier.contains("model-b", key(1))
    assert not tier.read_into("model-b", key(1), np.zeros(CHUNK, dtype=np.uint8))


def test_batches_fail_chunk_by_chunk(tmp_path, tiers, direct_io):
    tier = open_tier(tiers, tmp_path, direct_io=direct_io)
    items = [(key(i), chunk(i)) for i in range(6)]
    assert tier.write_many(NS, items) == [True] * 6
    with open(payload_file(tmp_path), "r+b") as f:  # corrupt the middle record of the run
        f.seek(3 * CHUNK + 1)
        f.write(b"\xff\xfe")
    outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(7)]
    result = tier.read_many(NS, [(key(i), outs[i]) for i in range(6)] + [(key(42), outs[6])])
    assert result == [True, True, True, False, True, True, False]
    for i in (0, 1, 2, 4, 5):
        assert np.array_equal(outs[i], chunk(i))
    assert tier.stats()["corrupt_chunks"] == 1 and not tier.contains(NS, key(3))


def test_the_chunks_a_batch_drops_are_logged_once(tmp_path, tiers, caplog):
    tier = open_tier(tiers, tmp_path)
    assert all(tier.write_many(NS, [(key(i), chunk(i)) for i in range(4)]))
    with open(payload_file(tmp_path), "r+b") as f:
        for record in (1, 2):
            f.seek(record * CHUNK + 7)
            f.write(b"\xff\xfe")
    outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(4)]
    with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
        assert tier.read_many(NS, [(key(i), outs[i]) for i in range(4)]) == [True, False, False, True]
    (line,) = [r.getMessage() for r in caplog.records if r.name == disk_module.__name__]
    assert "2 chunks of namespace ns0 failed their checksum" in line and tier.stats()["corrupt_chunks"] == 2


def test_a_read_returns_to_its_thread_before_it_is_verified(tmp_path, tiers, monkeypatch):
    """The reading thread takes its next batch while the digest threads verify the last one,
    and a second read from that thread leaves the first one's staging memory alone."""
    size = CHUNK - 100  # not a whole number of blocks: read through staging, copied out once verified
    tier = open_tier(tiers, tmp_path)
    assert all(tier.write_many(NS, [(key(i), chunk(i, size)) for i in range(4)]))
    release = threading.Event()
    real = disk_reads.payload_hasher

    def held(namespace, chunk_key):
        assert release.wait(10)
        return real(namespace, chunk_key)

    monkeypatch.setattr(disk_reads, "payload_hasher", held)
    outs = [np.zeros(size, dtype=np.uint8) for _ in range(4)]
    first = tier.start_reads(NS, [(key(i), outs[i]) for i in (0, 1)])
    second = tier.start_reads(NS, [(key(i), outs[i]) for i in (2, 3)])
    assert not first.done() and not second.done()
    release.set()
    assert first.result(10) == [True, True] and second.result(10) == [True, True]
    assert all(np.array_equal(outs[i], chunk(i, size)) for i in range(4))
    assert tier.stats()["read"] == 4


def test_a_wrong_size_chunk_is_refused_before_anything_is_allocated(tmp_path, tiers):
    tier = open_tier(tiers, tmp_path)
    with pytest.raises(ValueError, match="namespace ns0 holds 16384"):
        tier.write_many(NS, [(key(1), chunk(1)), (key(2), chunk(2, size=CHUNK // 2))])
    assert tier.stats()["allocated"] == 0 and tier.keys(NS) == []
    assert tier.write(NS, key(1), chunk(1))


def test_evicting_a_full_attention_chunk_drops_the_other_groups_at_its_position(tmp_path, tiers):
    capacity = 4 * (HEADER_BYTES + CHUNK)
    removed = []
    tier = open_tier(tiers, tmp_path, capacity=capacity, on_change=lambda ns, keys, present: present or removed.extend(keys))
    tier.set_anchor_groups(NS, [0])
    position = [key(0, group=g) for g in (0, 1, 2)]
    for i, k in enumerate(position + [key(1)]):
        assert tier.write(NS, k, chunk(i))
    assert tier.write(NS, key(2), chunk(9))  # full: the oldest (position 0's anchor) goes, with its window and state
    assert removed[0] == position[0] and set(removed) == set(position)
    assert tier.stats()["evicted_with_anchor"] == 2
    assert tier.contains(NS, key(1)) and tier.contains(NS, key(2))
    assert tier.write(NS, key(3), chunk(10)) and tier.write(NS, key(4), chunk(11))  # freed records are reused
    assert tier.stats()["allocated"] <= capacity


def test_a_long_run_of_neighbours_is_read_in_bounded_calls_and_verified(tmp_path, tiers, monkeypatch):
    """Reads keep few requests queued (READ_RUN_BYTES per call); every chunk still verifies."""
    monkeypatch.setattr(disk_reads, "READ_RUN_BYTES", 3 * CHUNK)
    tier = open_tier(tiers, tmp_path)
    keys = [key(i) for i in range(10)]
    assert all(tier.write_many(NS, [(k, chunk(i)) for i, k in enumerate(keys)]))
    sizes = call_sizes(monkeypatch, "preadv", kind=None)
    outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
    assert all(tier.read_many(NS, list(zip(keys, outs))))
    # The headers first, in one call; then the payloads.
    assert sizes == [("headers", 10 * HEADER_BYTES)] + [("payloads", 3 * CHUNK)] * 3 + [("payloads", CHUNK)]
    for i, out in enumerate(outs):
        assert np.array_equal(out, chunk(i))


def test_reads_are_planned_as_bounded_aligned_ranges_that_shrink_at_the_end():
    record = 5 * 4096
    records = [0, 1, 2, 7]  # record 7 is no neighbour of record 2
    pieces = disk_reads._read_pieces(records, record, piece_bytes=8192, last_bytes=4096)
    segments = [segment for piece in pieces for segment in piece]
    # Every byte of every record exactly once, in order.
    assert [n for n, _, _ in segments] == sorted(n for n, _, _ in segments)
    for n in range(len(records)):
        spans = [(first, end) for m, first, end in segments if m == n]
        assert spans[0][0] == 0 and spans[-1][1] == record
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    for piece in pieces:
        assert all(b[0] == a[0] + 1 and b[1] == 0 and a[2] == record for a, b in zip(piece, piece[1:]))
        assert all(records[b[0]] == records[a[0]] + 1 for a, b in zip(piece, piece[1:])), "one contiguous range"
        assert all(first % 4096 == 0 and end % 4096 == 0 for _, first, end in piece)
    sizes = [sum(end - first for _, first, end in piece) for piece in pieces]
    assert max(sizes) == 8192 and sizes[-3:] == [4096] * 3  # the last reads shrink: little left to hash


def test_a_read_never_leaves_a_sliver_of_a_record_for_a_call_of_its_own():
    """A payload as large as a read plus its header was read as one full read, then a 4 KiB one."""
    record = 3 * 4096  # a two-page payload and its header
    pieces = disk_reads._read_pieces([0, 5], record, piece_bytes=8192, last_bytes=8192, packed=False)
    assert pieces == [[(0, 0, record)], [(1, 0, record)]]
    # Where the rest is no sliver, a record is still split, and its last reads halve.
    pieces = disk_reads._read_pieces([0], 5 * 4096, piece_bytes=8192, last_bytes=4096, packed=False)
    assert [end - first for piece in pieces for _, first, end in piece] == [8192, 4096, 4096, 4096]


def test_a_chunk_larger_than_a_read_is_verified_piece_by_piece(tmp_path, tiers, monkeypatch, direct_io):
    """Records bigger than READ_RUN_BYTES are read in pieces and hashed as each piece lands:
    every byte still counts, wherever a flipped byte or a torn end falls."""
    record = CHUNK
    monkeypatch.setattr(disk_reads, "READ_RUN_BYTES", 8192)
    monkeypatch.setattr(disk_reads, "LAST_READ_BYTES", 4096)
    tier = open_tier(tiers, tmp_path, direct_io=direct_io)
    keys = [key(i) for i in range(3)]
    assert all(tier.write_many(NS, [(k, chunk(i)) for i, k in enumerate(keys)]))
    sizes = call_sizes(monkeypatch, "preadv")
    outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
    assert all(tier.read_many(NS, list(zip(keys, outs))))
    assert max(sizes) == 8192 and sum(sizes) == 3 * record and sizes[-1] == 4096
    assert all(np.array_equal(out, chunk(i)) for i, out in enumerate(outs))
    with open(payload_file(tmp_path), "r+b") as f:
        f.seek(2 * record - 10)  # the last bytes of record 1: not in the piece holding its header
        f.write(b"\xff\xfe\xfd")
        f.truncate(2 * record + 8192)  # record 2 torn after its first piece
    outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
    assert tier.read_many(NS, list(zip(keys, outs))) == [True, False, False]
    assert np.array_equal(outs[0], chunk(0))
    stats = tier.stats()
    assert stats["corrupt_chunks"] == 1 and stats["read_errors"] == 1
    assert tier.keys(NS) == [keys[0]]


def test_a_long_run_is_written_in_growing_bounded_calls_sealed_apart_and_verified(tmp_path, tiers, monkeypatch):
    """Writes start short and double up to WRITE_RUN_BYTES while the digest threads seal the
    next run; each run's headers go out in one call after its payloads, and after the next run's."""
    monkeypatch.setattr(disk_writes, "FIRST_WRITE_RUN_BYTES", CHUNK)
    monkeypatch.setattr(disk_writes, "WRITE_RUN_BYTES", 4 * CHUNK)
    tier = open_tier(tiers, tmp_path)
    sizes = call_sizes(monkeypatch, "pwritev", kind=None)
    keys = [key(i) for i in range(10)]
    assert all(tier.write_many(NS, [(k, chunk(i)) for i, k in enumerate(keys)]))
    payloads = [("payloads", n * CHUNK) for n in (1, 2, 4, 3)]
    headers = [("headers", n * HEADER_BYTES) for n in (1, 2, 4, 3)]
    assert sizes == [payloads[0], payloads[1], headers[0], payloads[2], headers[1], payloads[3], headers[2], headers[3]]
    tier.close()
    again = open_tier(tiers, tmp_path)  # every record's header and digest made it to disk
    outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in keys]
    assert all(again.read_many(NS, list(zip(keys, outs))))
    for i, out in enumerate(outs):
        assert np.array_equal(out, chunk(i))


def test_a_write_that_fails_midway_stores_nothing_after_it(tmp_path, tiers, monkeypatch):
    monkeypatch.setattr(disk_writes, "WRITE_RUN_BYTES", 2 * CHUNK)
    tier = open_tier(tiers, tmp_path, direct_io=False)
    real_pwritev = os.pwritev
    calls = []

    def failing_second(fd, buffers, offset):
        calls.append(file_kind(fd))
        if len(calls) == 2:
            raise OSError(5, "Input/output error")
        return real_pwritev(fd, buffers, offset)

    monkeypatch.setattr(os, "pwritev", failing_second)
    stored = tier.write_many(NS, [(key(i), chunk(i)) for i in range(6)])
    assert stored == [True, True, False, False, False, False]
    # The second run's payloads fail; the first run's headers still go out, nothing after.
    assert calls == ["payloads", "payloads", "headers"]
    assert tier.keys(NS) == [key(0), key(1)] and tier.stats()["write_errors"] == 1
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert tier.read_into(NS, key(1), out) and np.array_equal(out, chunk(1))
    assert not tier.read_into(NS, key(2), out)


def test_a_slab_grows_ahead_in_steps_allocated_before_they_are_written(tmp_path, tiers, monkeypatch):
    record = CHUNK + HEADER_BYTES
    monkeypatch.setattr(disk_index, "GROW_MIN_BYTES", 4 * record)
    grown = []
    real_fallocate = os.posix_fallocate

    def fallocate(fd, start, size):
        grown.append((file_kind(fd), start // HEADER_BYTES, size // HEADER_BYTES))  # in pages
        real_fallocate(fd, start, size)

    monkeypatch.setattr(os, "posix_fallocate", fallocate)

    def steps(*records):  # payloads (4 pages each) and their headers (1 page each)
        return [grown for first, end in records for grown in [("payloads", 4 * first, 4 * (end - first)), ("headers", first, end - first)]]

    tier = open_tier(tiers, tmp_path, capacity=10 * record)
    assert all(tier.write_many(NS, [(key(i), chunk(i)) for i in range(3)]))
    assert tier.write(NS, key(3), chunk(3))  # a reserved record: nothing to grow
    assert grown == steps((0, 4)) and tier.stats()["allocated"] == 4 * record
    assert tier.write(NS, key(4), chunk(4))
    assert tier.write_many(NS, [(key(i), chunk(i)) for i in range(5, 10)]) == [True] * 5
    assert grown == steps((0, 4), (4, 8), (8, 10))  # the last step: what capacity allows
    assert disk_bytes(tmp_path) == tier.stats()["allocated"] == 10 * record
    tier.close()
    again = open_tier(tiers, tmp_path, capacity=10 * record)
    outs = [np.zeros(CHUNK, dtype=np.uint8) for _ in range(10)]
    assert all(again.read_many(NS, [(key(i), outs[i]) for i in range(10)]))
    assert all(np.array_equal(outs[i], chunk(i)) for i in range(10))


def test_a_filesystem_that_cannot_allocate_ahead_still_stores(tmp_path, tiers, monkeypatch, caplog):
    def unsupported(fd, start, size):
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    tier = open_tier(tiers, tmp_path)
    with caplog.at_level("INFO", logger="kvstrata.tiers.disk"):
        for i in range(3):
            assert tier.write(NS, key(i), chunk(i))
    assert sum("cannot allocate ahead" in r.message for r in caplog.records) == 1
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert tier.read_into(NS, key(2), out) and np.array_equal(out, chunk(2))


def test_a_disk_too_full_to_allocate_new_records_stores_nothing_of_the_batch(tmp_path, tiers, monkeypatch):
    monkeypatch.setattr(disk_writes, "WRITE_RUN_BYTES", 2 * CHUNK)
    tier = open_tier(tiers, tmp_path)

    def full(fd, start, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert tier.write_many(NS, [(key(i), chunk(i)) for i in range(5)]) == [False] * 5
    stats = tier.stats()
    assert stats["write_errors"] == 1 and stats["admitting"] is False and tier.keys(NS) == []
    assert disk_bytes(tmp_path) == 0


def test_a_namespace_gets_room_from_another_ones_unused_reservation(tmp_path, tiers, caplog):
    record = CHUNK + HEADER_BYTES
    tier = open_tier(tiers, tmp_path, capacity=10 * record)
    assert tier.write("model-a", key(0), chunk(0))  # reserves what capacity allows for model-a
    assert tier.stats()["allocated"] == 10 * record
    with caplog.at_level("INFO", logger="kvstrata.tiers.disk"):
        assert all(tier.write_many("model-b", [(key(i), chunk(i)) for i in range(1, 6)]))
    assert sum("given back for namespace model-b" in r.message for r in caplog.records) == 1
    assert disk_bytes(tmp_path) == tier.stats()["allocated"] <= 10 * record
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert tier.read_into("model-a", key(0), out) and np.array_equal(out, chunk(0))
    assert tier.read_into("model-b", key(5), out) and np.array_equal(out, chunk(5))
    tier.close()
    again = open_tier(tiers, tmp_path, capacity=10 * record)  # what is on disk is what was counted
    assert again.stats()["allocated"] == disk_bytes(tmp_path)
    assert again.read_into("model-a", key(0), out) and np.array_equal(out, chunk(0))


def test_a_failure_while_sealing_gives_every_record_back(tmp_path, tiers, monkeypatch):
    record = CHUNK + HEADER_BYTES
    tier = open_tier(tiers, tmp_path, capacity=4 * record)

    def broken(out, namespace, key, payload):
        raise RuntimeError("digest failed")

    with monkeypatch.context() as patched:
        patched.setattr(disk_writes, "seal_header", broken)
        with pytest.raises(RuntimeError, match="digest failed"):
            tier.write_many(NS, [(key(i), chunk(i)) for i in range(4)])
    assert tier.keys(NS) == []
    assert tier.write_many(NS, [(key(i), chunk(i)) for i in range(4, 8)]) == [True] * 4  # all 4 records usable again
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert tier.read_into(NS, key(7), out) and np.array_equal(out, chunk(7))


def test_a_verification_that_fails_to_run_is_a_miss_not_a_crash(tmp_path, tiers, monkeypatch, caplog):
    tier = open_tier(tiers, tmp_path)
    assert tier.write(NS, key(1), chunk(1))

    def broken(namespace, key):
        raise RuntimeError("verifier broke")

    with monkeypatch.context() as patched:
        patched.setattr(disk_reads, "payload_hasher", broken)
        out = np.zeros(CHUNK, dtype=np.uint8)
        assert tier.read_many(NS, [(key(1), out)]) == [False]
    assert "not verified" in caplog.text and tier.stats()["read_errors"] == 1
    assert not tier.contains(NS, key(1))
    assert tier.write(NS, key(1), chunk(1))  # its record is free again
    assert tier.read_into(NS, key(1), out) and np.array_equal(out, chunk(1))


@pytest.fixture
def aligned(monkeypatch):
    """Test-sized chunks get the layout large ones get: payloads on 64 KiB boundaries."""
    monkeypatch.setattr(disk_slab, "ALIGNED_FROM_BYTES", CHUNK)
    return 64 << 10  # stride: the 16 KiB payload and its 48 KiB gap


def test_large_chunks_start_on_aligned_boundaries_and_survive_a_restart(tmp_path, tiers, monkeypatch, aligned, direct_io):
    stride = aligned
    record = stride + HEADER_BYTES  # what capacity counts
    tier = open_tier(tiers, tmp_path, capacity=4 * record, direct_io=direct_io)
    writes = call_sizes(monkeypatch, "pwritev", kind=None)
    assert tier.write_many(NS, [(key(i), page_aligned_chunk(i)) for i in range(4)]) == [True] * 4
    # Records that do not touch on disk are written one by one, each header after the next payload.
    payload, header = ("payloads", CHUNK), ("headers", HEADER_BYTES)
    assert writes == [payload, payload, header, payload, header, payload, header, header]
    path = payload_file(tmp_path)
    assert path.name.endswith(f"-{CHUNK}-a{aligned}.payloads")
    data = path.read_bytes()
    for record_index in range(4):  # the write order gave key i record i
        assert data[record_index * stride : record_index * stride + CHUNK] == chunk(record_index).tobytes()
    assert tier.write(NS, key(4), chunk(4))  # full: the least recently used goes
    assert disk_bytes(tmp_path) == tier.stats()["allocated"] == 4 * record
    assert not tier.contains(NS, key(0))
    tier.close()
    monkeypatch.setattr(disk_slab, "ALIGNED_FROM_BYTES", 1 << 20)  # the layout comes from the file name
    again = open_tier(tiers, tmp_path, capacity=4 * record, direct_io=direct_io)
    reads = call_sizes(monkeypatch, "preadv")
    outs = {i: np.zeros(CHUNK, dtype=np.uint8) for i in range(1, 5)}
    assert again.read_many(NS, [(key(i), out) for i, out in outs.items()]) == [True] * 4
    assert all(size <= CHUNK for size in reads), "a read never spans the gap between payloads"
    assert all(np.array_equal(out, chunk(i)) for i, out in outs.items())
    with open(path, "r+b") as f:  # key 2 is still in record 2: flip a byte of its payload
        f.seek(2 * stride + 100)
        f.write(b"\xff" if data[2 * stride + 100] != 0xFF else b"\x00")
    assert not again.read_into(NS, key(2), np.zeros(CHUNK, dtype=np.uint8))
    assert again.stats()["corrupt_chunks"] == 1


def test_a_packed_slab_written_before_keeps_serving_and_storing(tmp_path, tiers, monkeypatch):
    """Slabs keep the layout their name says, whatever new slabs would get; nothing is lost."""
    first = open_tier(tiers, tmp_path)
    assert all(first.write_many(NS, [(key(i), chunk(i)) for i in range(3)]))
    first.close()
    monkeypatch.setattr(disk_slab, "ALIGNED_FROM_BYTES", CHUNK)
    again = open_tier(tiers, tmp_path)
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert again.read_into(NS, key(1), out) and np.array_equal(out, chunk(1))
    assert again.write(NS, key(3), chunk(3))
    assert payload_file(tmp_path).name == f"{NS}-{CHUNK}.payloads"  # still the one packed slab
    assert again.read_into(NS, key(3), out) and np.array_equal(out, chunk(3))


def test_a_crash_between_a_runs_payloads_and_its_headers_is_never_served(tmp_path, tiers, monkeypatch):
    """Payloads go out before their headers: a crash in between leaves the old header over
    the new payload, which fails its digest."""
    tier = open_tier(tiers, tmp_path, capacity=CHUNK + HEADER_BYTES)  # one record
    assert tier.write(NS, key(1), chunk(1))
    real = disk_writes._write_fully
    writes: list[tuple[str, int]] = []

    def crash_at_the_header(fd, iovecs, offset):
        writes.append((file_kind(fd), sum(v.nbytes for v in iovecs)))
        if writes[-1][0] == "headers":
            raise OSError(5, "the store was killed here")
        real(fd, iovecs, offset)

    monkeypatch.setattr(disk_writes, "_write_fully", crash_at_the_header)
    assert not tier.write(NS, key(2), page_aligned_chunk(2))  # key(1) was evicted for it
    assert writes == [("payloads", CHUNK), ("headers", HEADER_BYTES)]
    tier.close()
    again = open_tier(tiers, tmp_path, capacity=CHUNK + HEADER_BYTES)
    assert again.keys(NS) == [key(1)]  # the old header is still there ...
    assert not again.read_into(NS, key(1), np.zeros(CHUNK, dtype=np.uint8))  # ... over key(2)'s payload
    assert again.stats()["corrupt_chunks"] == 1 and again.keys(NS) == []


def test_slab_files_of_the_one_file_layout_are_removed_at_start_up(tmp_path, tiers, caplog):
    """A `[header | payload]` slab from before the header files holds nothing this store
    reads; left there it would take disk nobody's capacity counts."""
    old = tmp_path / f"{NS}-{CHUNK}.slab"
    old.write_bytes(b"\xa5" * (3 * (HEADER_BYTES + CHUNK)))
    (tmp_path / "notes.txt").write_text("an operator's file")
    with caplog.at_level(logging.WARNING, logger=disk_module.__name__):
        tier = open_tier(tiers, tmp_path)
    assert not old.exists() and (tmp_path / "notes.txt").exists()
    (line,) = [r.getMessage() for r in caplog.records if r.name == disk_module.__name__]
    assert "removed 1 slab files of an earlier layout" in line
    assert tier.stats()["allocated"] == 0 and tier.keys(NS) == []
    assert tier.write(NS, key(1), chunk(1))


def test_records_past_the_end_of_a_cut_short_header_file_are_empty_and_reused(tmp_path, tiers, direct_io):
    first = open_tier(tiers, tmp_path, direct_io=direct_io)
    assert all(first.write_many(NS, [(key(i), chunk(i)) for i in range(4)]))
    first.close()
    os.truncate(header_file(tmp_path), 2 * HEADER_BYTES)  # the headers of records 2 and 3 are lost
    again = open_tier(tiers, tmp_path, direct_io=direct_io)
    assert sorted(again.keys(NS)) == sorted([key(0), key(1)])
    out = np.zeros(CHUNK, dtype=np.uint8)
    assert again.read_into(NS, key(1), out) and np.array_equal(out, chunk(1))
    assert all(again.write_many(NS, [(key(i), chunk(i)) for i in range(10, 12)]))
    for i in (0, 1, 10, 11):
        assert again.read_into(NS, key(i), out) and np.array_equal(out, chunk(i)), i


@pytest.mark.parametrize("with_reuse", [False, True], ids=["lru", "reuse"])
def test_with_reuse_estimates_eviction_takes_the_one_offs_among_the_oldest_first(tmp_path, tiers, with_reuse):
    """admission.store: reuse (issue #28): the oldest records are weighed by their estimated
    reuse, so reused prefixes outlive one-offs written after them; without it, pure LRU."""
    record = HEADER_BYTES + CHUNK
    removed = []
    tier = open_tier(tiers, tmp_path, capacity=6 * record, on_change=lambda ns, keys, present: present or removed.extend(keys))
    reused = {key(0), key(1), key(2)}  # the oldest three, but used again and again
    asked = []
    if with_reuse:
        tier.reuse_of = reuse_estimate(reused, asked)
    assert tier.write_many(NS, [(key(i), chunk(i)) for i in range(6)]) == [True] * 6
    assert tier.write_many(NS, [(key(i), chunk(i)) for i in range(10, 13)]) == [True] * 3
    if with_reuse:
        assert sorted(removed) == sorted([key(3), key(4), key(5)])
        assert asked and all(namespace == NS for namespace, _ in asked)
    else:
        assert removed == [key(0), key(1), key(2)]
    assert tier.stats()["evicted"] == 3
    out = np.zeros(CHUNK, dtype=np.uint8)
    for i in ([0, 1, 2] if with_reuse else [3, 4, 5]) + [10, 11, 12]:
        assert tier.read_into(NS, key(i), out) and np.array_equal(out, chunk(i)), i


def test_reuse_eviction_keeps_age_beyond_its_window(tmp_path, tiers):
    """A reused record younger than the window's oldest records is not protected at their
    expense forever: the window is the oldest REUSE_EVICTION_WINDOW, so age still rules."""
    record = HEADER_BYTES + CHUNK
    window = disk_index.REUSE_EVICTION_WINDOW
    removed = []
    tier = open_tier(tiers, tmp_path, capacity=2 * window * record, on_change=lambda ns, keys, present: present or removed.extend(keys))
    tier.reuse_of = lambda namespace, keys: [1 if k == key(window) else 9 for k in keys]  # a one-off outside the first window
    assert tier.write_many(NS, [(key(i), chunk(i)) for i in range(2 * window)]) == [True] * (2 * window)
    assert tier.write_many(NS, [(key(100), chunk(100))]) == [True]
    assert removed == [key(0)]  # the oldest window is all reused alike: the oldest of it goes
