"""The node arena: fixed-size slots in shared-memory files, one pool per layout namespace.

Invariants the rest of the system relies on:
- A slot is in exactly one state: free, reserved (by one holder), committed (indexed
  under one key), or orphaned (committed bytes no longer indexed, kept alive only by
  pins). Bytes of a committed or orphaned slot never change until it is freed.
- Eviction only takes committed slots that nobody pins; reserved slots and pinned
  slots are never touched, so a HIT handed to vLLM stays loadable.
- Pins are counted per holder and slot: each pin is undone by exactly one unpin (a
  holder's unpin of an old pin must not undo its newer pin of the slot: issue #37).
- Pins and reservations belong to a holder (an engine) and die with its lease.
- A slot whose chunk left the index is reused only once every engine that answers
  HITs from a mirror has seen it go (`kvstrata.tiers.reuse`), so a HIT answered
  before its pin reached the store still reads its chunk's bytes.
- Segments are named with the arena's epoch, so a restarted store never hands out a
  file that a worker of the previous store still has mapped under the same name.
- A pool's segment numbers (so its slot numbers and file names) are never reused: a
  wholly idle pool gives its segments back to the budget (`kvstrata.tiers.giveback`) and
  grows later into new numbers, so no worker resolves a slot to a file it mapped before.
- The arena's capacity never shrinks while it lives; budget is shared by all namespaces, and a
  tenant's pools never grow past its quota (`kvstrata.tiers.quotas`): at it they evict
  their own chunks, never another tenant's.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable

import numpy as np

from kvstrata.keys import key_name
from kvstrata.namespaces import check_namespace
from kvstrata.tiers.geometry import PoolGeometry  # noqa: F401 (imported from here across the code)
from kvstrata.tiers.giveback import make_room
from kvstrata.tiers.leases import LeaseTable
from kvstrata.tiers.orphans import Reclaimed, log_reclaimed, orphan_candidates, reclaim
from kvstrata.tiers.policies import EvictionPolicy, make_policy
from kvstrata.tiers.positions import Positions
from kvstrata.tiers.quotas import TenantQuotas
from kvstrata.tiers.reuse import DeferredReuse
from kvstrata.tiers.shm import SharedMemoryFile

logger = logging.getLogger(__name__)

FILE_PREFIX = "kvstrata"
GROW_RETRY_SECONDS = 1.0  # after a segment could not be created


class SlotError(ValueError):
    """A request about a slot that the caller does not own; names the slot and namespace."""


class SlotPool:
    """Slots of one layout namespace. Not thread-safe: the node store serialises calls.

    `on_change(keys, present)` hears every index change, a batch at a time. `on_evict(key, slot)` may claim an
    evicted slot (write-back to disk, to the object store, or both): it returns the holder
    names that keep the bytes pinned as an orphan until each unpins them; none frees the
    slot at once.

    Hybrid models: once `positions` knows the anchor (full-attention) groups, evicting an
    anchor chunk also evicts the unpinned chunks of the other groups at its position.
    """

    def __init__(self, arena: "Arena", geometry: PoolGeometry, policy: EvictionPolicy):
        self.arena = arena
        self.geometry = geometry
        self.policy = policy
        self.segments: dict[int, SharedMemoryFile] = {}  # segment number -> its file
        self.num_slots = 0  # slots of the live segments (the budget this pool holds)
        self._next_segment = 0  # segment numbers are never reused (module docstring)
        self._free: list[int] = []
        self._reserved: dict[int, str] = {}
        self._slot_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._orphans: set[int] = set()
        # orphan -> the evicted chunk it still holds, and the log sequence of its removal
        self._orphan_key: dict[int, tuple[bytes, int]] = {}
        self.reuse = DeferredReuse()
        self._pins: dict[int, dict[str, int]] = {}  # slot -> holder -> pins it holds there
        self._held: dict[str, set[int]] = {}
        self.on_change: Callable[[list[bytes], bool], None] | None = None
        self.on_evict: Callable[[bytes, int], list[str]] | None = None
        self.positions = Positions()
        self.counters = {
            "evicted": 0,
            "evicted_with_anchor": 0,
            "committed": 0,
            "duplicate_commits": 0,
            "reserve_shortfall": 0,
            "grow_failures": 0,
            "holds": 0,
            "holds_refused": 0,
        }
        self._grow_retry_at = float("-inf")
        self._pressed = False  # reservations wait on evicted slots (see `reserve`)
        self.given_back = 0  # times this pool gave its segments back (`give_back`)

    @property
    def namespace(self) -> str:
        return self.geometry.namespace

    # --- index views -------------------------------------------------------------

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def lookup(self, key: bytes) -> int | None:
        return self._slot_of.get(key)

    def keys(self) -> list[bytes]:
        return list(self._slot_of)

    def key_at(self, slot: int) -> bytes | None:
        return self._key_of.get(slot)

    def view(self, slot: int) -> np.ndarray:
        """The bytes of one slot (a view into shared memory)."""
        segment, offset = self.geometry.locate(slot)
        mapped = self.segments.get(segment) if slot >= 0 else None
        if mapped is None or offset + self.geometry.slot_bytes > mapped.size:
            raise SlotError(f"slot {slot} does not exist in namespace {self.namespace}")
        return mapped.array[offset : offset + self.geometry.slot_bytes]

    # --- state transitions -----------------------------------------------------------

    def reserve(self, holder: str, count: int) -> list[int]:
        """Up to `count` free slots for `holder`, growing the arena or evicting LRU chunks.

        At most `count` chunks are evicted per call: with write-back an evicted slot
        frees only once its bytes reached disk, and one reservation must not push the
        whole arena out.

        With watchers, an evicted slot frees only at their next acknowledgement (deferred
        reuse), a step later: a call that falls short has evicted what it lacked for the
        next call. Once that happened (the pool is *pressed*), a call granted in full that
        leaves no free slot evicts ahead, so that up to `count` slots are on their way for
        the next call; a call that leaves free slots ends the pressure. Without it a steady stream of
        reservations would be granted every other step (measured: 59 % of vLLM's stores
        on a trace that overflows the arena).
        """
        granted: list[int] = []
        coming = 0  # slots this call evicted that free later (deferred reuse, write-back)
        while len(granted) + coming < count:
            if self._free or self._grow():
                slot = self._free.pop()
                self._reserved[slot] = holder
                granted.append(slot)
                continue
            if not self._evict_one():
                break
            if not self._free:
                coming += 1
        if len(granted) < count:
            self.counters["reserve_shortfall"] += count - len(granted)
            self._pressed = coming > 0
        elif self._free:
            self._pressed = False
        elif self._pressed and self.reuse.watchers:
            ahead = min(count, count - len(self._free) - len(self.reuse))
            while ahead > 0 and (self._grow() or self._evict_one()):
                ahead = min(ahead - 1, count - len(self._free) - len(self.reuse))
        return granted

    @property
    def orphans(self) -> int:
        """Evicted slots still held by a write-back: they free up as their copies finish."""
        return len(self._orphans)

    @property
    def settling(self) -> int:
        """Slots that are neither free nor usable yet but will be soon: orphans held by a
        copy to another tier, and slots waiting for engines to see their chunk go."""
        return len(self._orphans) + len(self.reuse)

    @property
    def max_slots(self) -> int:
        """Slots this pool could have if it had the whole arena budget (its tenant's quota)."""
        quota = self.arena.quotas.limit(self.namespace)
        return max(1, min(self.arena.capacity, quota or self.arena.capacity) // self.geometry.slot_bytes)

    def release(self, holder: str, slots: Iterable[int]) -> None:
        """Return reserved slots that will not be written (failed or unused stores)."""
        for slot in slots:
            if self._reserved.get(slot) == holder:
                del self._reserved[slot]
                self._free.append(slot)

    def commit(self, holder: str, slot: int, key: bytes) -> bool:
        """Publish a written slot under `key`; the writer keeps a pin on it.

        Returns False when another engine committed the same key first: the slot is then
        kept as an orphan for as long as the writer pins it (its loads may already point
        at it), and the index keeps the first copy.
        """
        committed, refused = self.commit_many(holder, [(slot, key)])
        if refused:
            raise SlotError(refused[0])
        return bool(committed)

    def commit_many(self, holder: str, items: Iterable[tuple[int, bytes]]) -> tuple[list[tuple[bytes, int]], list[str]]:
        """`commit` for a batch of (slot, key): the newly indexed (key, slot) pairs, and why
        each refused item was refused (its slot is left as it was).

        Why a batch: an engine commits a step's chunks at once (thousands when a long prompt
        lands), and one change-log call for all of them keeps the store's lock short
        (measured: ~8 us per chunk committed one by one, most of it per-call overhead).
        """
        reserved, slot_of, key_of = self._reserved, self._slot_of, self._key_of
        committed: list[tuple[bytes, int]] = []
        refused: list[str] = []
        written: list[int] = []
        for slot, key in items:
            if reserved.get(slot) != holder:
                refused.append(
                    f"cannot commit chunk {key_name(key)}: slot {slot} of namespace "
                    f"{self.namespace} is not reserved by {holder}"
                )
                continue
            del reserved[slot]
            written.append(slot)
            if key in slot_of:
                self._orphans.add(slot)
                self.counters["duplicate_commits"] += 1
                continue
            slot_of[key] = slot
            key_of[slot] = key
            committed.append((key, slot))
        self.pin_slots(holder, written)
        add = self.policy.add
        for key, slot in committed:
            add(slot)
        keys = [key for key, _ in committed]
        self.positions.add_many(keys)
        self._record(keys, added=True)
        self.counters["committed"] += len(committed)
        return committed, refused

    def pin_slots(self, holder: str, slots: list[int]) -> None:
        """Pin slots the caller knows to be committed (a copy to another tier holds them),
        once more each: each pin is undone by one unpin."""
        pins = self._pins
        for slot in slots:
            holders = pins.get(slot)
            if holders is None:
                pins[slot] = {holder: 1}
            else:
                holders[holder] = holders.get(holder, 0) + 1
        if slots:
            self._held.setdefault(holder, set()).update(slots)

    def pin(self, holder: str, keys: Iterable[bytes]) -> dict[bytes, int]:
        """Pin the resident keys for `holder`; absent keys are simply left out."""
        pinned: dict[bytes, int] = {}
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None:
                continue
            self.policy.touch(slot)
            pinned[key] = slot
        self.pin_slots(holder, list(pinned.values()))
        return pinned

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark resident keys as recently used (reuse seen by an engine)."""
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is not None:
                self.policy.touch(slot)

    def unpin(self, holder: str, slots: Iterable[int], every: bool = False) -> None:
        """Undo one pin of `holder` per slot listed (`every`: all); other slots are ignored."""
        for slot in slots:
            holders = self._pins.get(slot)
            count = holders.get(holder, 0) if holders is not None else 0
            if not count:
                continue
            if count > 1 and not every:
                holders[holder] = count - 1
                continue
            del holders[holder]
            self._held[holder].discard(slot)
            if not holders:
                del self._pins[slot]
                if slot in self._orphans:
                    self._orphans.discard(slot)
                    self._retire(slot, *self._orphan_key.pop(slot, (None, None)))

    def watch(self, holder: str, seq: int) -> None:
        """`holder` answers HITs from a mirror of this pool's index taken at `seq`."""
        self.reuse.watch(holder, seq)

    def acknowledge(self, holder: str, seq: int) -> None:
        """`holder` applied the index changes up to `seq`; after its holds, never before."""
        self._free.extend(self.reuse.acknowledge(holder, seq))

    def hold(self, holder: str, items: Iterable[tuple[bytes, int]]) -> list[str]:
        """Pin the slots of HITs `holder` answered from its mirror: (key, slot) as it saw them.

        The slot holds the key's bytes if it is still indexed under it, an orphan of it,
        or waiting for reuse since the key left (deferred reuse guarantees it was not
        handed out since). Anything else is refused, counted and named: the engine's
        load would read another chunk, which the protocol rules out.
        """
        refused: list[str] = []
        for key, slot in items:
            if self._slot_of.get(key) == slot:
                self.policy.touch(slot)
            elif self._orphan_key.get(slot, (None,))[0] != key:
                if not self.reuse.claim(slot, key):
                    self.counters["holds_refused"] += 1
                    refused.append(
                        f"cannot hold chunk {key_name(key)}: slot {slot} of namespace {self.namespace} no longer holds it"
                    )
                    continue
                self._orphans.add(slot)
                self._orphan_key[slot] = (key, self.reuse.seq())
            self.pin_slots(holder, [slot])
            self.counters["holds"] += 1
        return refused

    def drop_holder(self, holder: str) -> int:
        """Forget every pin and reservation of a holder (lease expired or engine gone)."""
        self._free.extend(self.reuse.forget(holder))
        pinned = list(self._held.get(holder, ()))
        self.unpin(holder, pinned, every=True)
        self._held.pop(holder, None)
        reserved = [slot for slot, owner in self._reserved.items() if owner == holder]
        self.release(holder, reserved)
        return len(pinned) + len(reserved)

    def purge(self, keys: Iterable[bytes] | None = None) -> int:
        """Drop every indexed chunk (or those of `keys`); pinned ones become orphans until unpinned."""
        removed, slot_of = 0, self._slot_of
        for key, slot in list(slot_of.items()) if keys is None else [(k, slot_of[k]) for k in keys if k in slot_of]:
            self._remove_index(key, slot)
            if slot in self._pins:
                self._orphans.add(slot)
                self._orphan_key[slot] = (key, self.reuse.seq())
            else:
                self._retire(slot, key)
            removed += 1
        return removed

    def holdings(self, holder: str) -> tuple[int, int]:
        """(slots `holder` pins, free slots reserved for it): what status shows per engine."""
        return len(self._held.get(holder, ())), sum(1 for owner in self._reserved.values() if owner == holder)

    def stats(self) -> dict[str, int]:
        return {
            "slots": self.num_slots,
            "slot_bytes": self.geometry.slot_bytes,
            "segments": len(self.segments),
            "huge_page_segments": sum(segment.huge_pages for segment in self.segments.values()),
            "segments_given_back": self.given_back,
            "resident": len(self._slot_of),
            "free": len(self._free),
            "reserved": len(self._reserved),
            "pinned": len(self._pins),
            "orphans": len(self._orphans),
            "awaiting_reuse": len(self.reuse),
            "awaiting_reuse_peak": self.reuse.peak,
            "watchers": self.reuse.watchers,
            **self.counters,
        }

    def close(self) -> None:
        for segment in self.segments.values():
            segment.close()
        self.segments.clear()

    # --- internals -------------------------------------------------------------------

    def _retire(self, slot: int, key: bytes | None, removed_at: int | None = None) -> None:
        """A slot leaves every index and pin: free now, or once every watcher saw `key` go
        (its removal from the index at log sequence `removed_at`, default: now)."""
        if not self.reuse.retire(slot, key, removed_at):
            self._free.append(slot)

    def _record(self, keys: list[bytes], added: bool) -> None:
        if self.on_change is not None and keys:
            self.on_change(keys, added)

    def _remove_index(self, key: bytes, slot: int) -> None:
        del self._slot_of[key]
        del self._key_of[slot]
        self.positions.remove(key)
        self.policy.remove(slot)
        self._record([key], added=False)

    def _evict_one(self) -> bool:
        for slot in self.policy.candidates():
            if slot in self._pins:
                continue
            key = self._key_of[slot]
            self._evict(key, slot)
            for dependent in self.positions.dependents(key):
                dependent_slot = self._slot_of[dependent]
                if dependent_slot not in self._pins:
                    self._evict(dependent, dependent_slot)
                    self.counters["evicted_with_anchor"] += 1
            return True
        return False

    def _evict(self, key: bytes, slot: int) -> None:
        self._remove_index(key, slot)
        self.counters["evicted"] += 1
        keepers = self.on_evict(key, slot) if self.on_evict is not None else []
        if not keepers:
            self._retire(slot, key)
        else:
            self._orphans.add(slot)
            self._orphan_key[slot] = (key, self.reuse.seq())
            for keeper in keepers:
                self.pin_slots(keeper, [slot])

    def _grow(self) -> bool:
        """Add a segment within the budget; False when the budget is spent or the shared
        memory has no room (then the pool evicts, or a reservation falls short: a miss,
        never a crash), retried at most once per `GROW_RETRY_SECONDS`."""
        if self.arena.clock() < self._grow_retry_at:
            return False
        segment_index = self._next_segment
        slots = self.arena.grant_slots(self.geometry.slot_bytes, self.geometry.slots_per_segment, self.namespace)
        if slots == 0:
            return False
        path = self.geometry.segment_path(segment_index)
        try:
            segment = SharedMemoryFile.create(path, slots * self.geometry.slot_bytes, prefault=self.arena.prefault)
        except OSError as exc:
            self.arena.return_slots(self.geometry.slot_bytes, slots, self.namespace)
            self.counters["grow_failures"] += 1
            self._grow_retry_at = self.arena.clock() + GROW_RETRY_SECONDS
            if self.counters["grow_failures"] == 1:
                logger.error(
                    "kvstrata arena: namespace %s cannot grow past %d slots: %s",
                    self.namespace, self.num_slots, exc.strerror or exc,
                )  # fmt: skip
            return False
        self.segments[segment_index] = segment
        self._next_segment = segment_index + 1
        first = segment_index * self.geometry.slots_per_segment
        # Hand out low slot numbers first: pop() takes from the end.
        self._free.extend(range(first + slots - 1, first - 1, -1))
        self.num_slots += slots
        return True


class Arena:
    """The CPU tier of one node: a byte budget shared by per-namespace slot pools."""

    def __init__(
        self,
        shm_dir: str,
        node_tag: str,
        capacity: int,
        segment_size: int,
        lease_seconds: float,
        eviction_policy: str = "lru",
        prefault: bool = True,
        clock: Callable[[], float] = time.monotonic,
        quotas: dict[str, int] | None = None,
    ):
        if capacity <= 0:
            raise ValueError(f"tiers.cpu.capacity must be positive, got {capacity}")
        if not os.path.isdir(shm_dir):
            raise ValueError(f"tiers.cpu.shm_dir: {shm_dir} is not a directory")
        make_policy(eviction_policy)  # fail now, not at the first namespace
        self.shm_dir = shm_dir
        self.node_tag = node_tag
        self.capacity = capacity
        self.segment_size = segment_size
        self.eviction_policy = eviction_policy
        self.prefault = prefault
        self.epoch = secrets.token_hex(4)
        self.leases = LeaseTable(lease_seconds, clock)
        self.clock = clock
        self._allocated = 0
        # Segment bytes per tenant: a pool at its tenant's quota evicts its own chunks.
        self.quotas = TenantQuotas(quotas)
        self.pools: dict[str, SlotPool] = {}
        # Segments no live store holds (this node's previous store, a dead cluster's, a
        # simulated node's): unlinked once every lease their store granted has run out, so
        # in-flight loads of its engines still find their bytes; locks checked again then.
        self._stale = orphan_candidates(shm_dir, f"{FILE_PREFIX}-*")
        self._stale_deadline = clock() + lease_seconds
        self.reclaimed = Reclaimed()  # what this arena unlinked of dead stores

    @property
    def allocated_bytes(self) -> int:
        return self._allocated

    def pool(self, namespace: str, slot_bytes: int) -> SlotPool:
        """The pool of a namespace, created on first use (its name is in the segments' file names)."""
        pool = self.pools.get(check_namespace(namespace))
        if pool is not None:
            if pool.geometry.slot_bytes != slot_bytes:
                raise ValueError(
                    f"namespace {namespace}: slot size {slot_bytes} differs from the "
                    f"existing pool's {pool.geometry.slot_bytes}"
                )
            return pool
        if not isinstance(slot_bytes, (int, np.integer)) or not 0 < slot_bytes <= self.capacity:
            raise ValueError(f"namespace {namespace}: slot size must be 1 to {self.capacity} bytes, got {slot_bytes!r}")
        slots_per_segment = max(1, self.segment_size // slot_bytes)
        template = os.path.join(
            self.shm_dir, f"{FILE_PREFIX}-{self.node_tag}-{self.epoch}-{namespace}-{{segment:04d}}"
        )
        geometry = PoolGeometry(namespace, slot_bytes, slots_per_segment, template)
        pool = SlotPool(self, geometry, make_policy(self.eviction_policy))
        self.pools[namespace] = pool
        logger.info(
            "kvstrata arena: new pool for namespace %s (slot %d bytes, %d slots per segment)",
            namespace,
            slot_bytes,
            slots_per_segment,
        )
        return pool

    def grant_slots(self, slot_bytes: int, wanted: int, namespace: str = "") -> int:
        """How many slots of this size a new segment may have within the budget and the
        namespace's tenant quota (0 = none)."""
        make_room(self, namespace, wanted * slot_bytes)  # idle pools give their segments back
        room = self.quotas.room(namespace)
        slots = min(wanted, (self.capacity - self._allocated) // slot_bytes)
        if room is not None:
            slots = min(slots, room // slot_bytes)
        if slots <= 0:
            return 0
        self._allocated += slots * slot_bytes
        self.quotas.charge(namespace, slots * slot_bytes)
        return slots

    def return_slots(self, slot_bytes: int, slots: int, namespace: str = "") -> None:
        """Give back budget granted for a segment that could not be created, or given back."""
        self._allocated -= slots * slot_bytes
        self.quotas.charge(namespace, -slots * slot_bytes)

    def renew(self, holder: str) -> None:
        self.leases.renew(holder)

    def expire(self) -> list[str]:
        """Drop holders whose lease ran out; returns them. Called on every store call."""
        expired = self.leases.take_expired()
        for holder in expired:
            dropped = sum(pool.drop_holder(holder) for pool in self.pools.values())
            logger.warning("kvstrata arena: lease of %s expired; released %d slots", holder, dropped)
        self.reclaim_due_orphans()
        return expired

    def reclaim_due_orphans(self) -> None:
        """Unlink the dead stores' segments found at start once their lease ran out (also called
        by the store's `stats`, so a store no engine talks to still frees them)."""
        if self._stale and self.clock() >= self._stale_deadline:
            self._remove_stale()

    def _remove_stale(self) -> None:
        found = reclaim(self._stale)
        log_reclaimed(found, self.shm_dir, f"found at store start, unlinked after a lease of {self.leases.duration_s:g}s")
        self.reclaimed.add(found)
        self._stale = []

    def release_holder(self, holder: str) -> None:
        """An engine that shuts down cleanly gives everything back at once."""
        self.leases.release(holder)
        for pool in self.pools.values():
            pool.drop_holder(holder)

    def stats(self) -> dict[str, object]:
        return {
            "epoch": self.epoch,
            "capacity": self.capacity,
            "allocated": self._allocated,
            "tenants": self.quotas.usage(),
            "holders": self.leases.holders(),
            "orphans_reclaimed": {"files": len(self.reclaimed.files), "bytes": self.reclaimed.bytes},
            "pools": {namespace: pool.stats() for namespace, pool in self.pools.items()},
        }

    def close(self) -> None:
        """Unlink every segment, the previous store's leftovers included."""
        if self._stale:
            self._remove_stale()
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        self._allocated = 0
        self.quotas.reset()
