"""vLLM's per-request calls: lookups and loads against pins, stores against the stock.

- A `lookup` answers from local state only: HIT for a chunk pinned for this engine in
  the current store epoch, or resident in the arena per the mirror (pinned here at
  once, its hold queued for the next request: deferred slot reuse keeps the slot),
  HIT_PENDING for one this engine is storing, RETRY while a promotion (or a fresher
  view of the store) is on its way, MISS otherwise -- and MISS, to recompute, once a
  request has waited `lookup_wait_seconds`, or `view_wait_steps` of this engine's steps
  on a store that said nothing meanwhile and for longer than it usually takes to answer
  (`SILENCE_ROUND_TRIPS` of its recent round trips; counted: `lookups_store_silent`). With
  `admission.load: break_even`, MISS from the chunk on where loading the rest from a
  lower tier would be slower than recomputing it (load_admission.py decides, once per
  request). No HIT from local state while the engine cannot prove its lease (its last
  answer is older than half a lease): the chunk is asked for like one on disk.
- `prepare_load` hands out the slots of pinned chunks; `complete_load` lets them go.
- `prepare_store` takes slots from the stock reserved in advance (head of the prefix
  first); `complete_store` commits or releases them.
- `on_request_finished` drops a request's claims; `reset_cache` forgets everything of
  the namespace and asks the store to purge it.

Writes: the fields in `WRITES` below (a test holds the list to the code): chiefly the
pins (loads, requests, pins of stored chunks), the stock, what is being stored, the
outgoing commits and releases, what a reset keeps until vLLM flushed, and the mirror for
chunks this engine stored or a reset cleared.

Invariants: rule 1 -- a HIT means "pinned for this engine, or held by deferred reuse
until its hold reaches the store", so its `prepare_load` cannot fail and its slot keeps
the chunk's bytes; a pinned slot stays pinned while a load may read it
(`loads`, and `_reset_pins` across a reset); rule 2 -- no call here blocks: what a
lookup needs from the store goes out with the step's request, and `prepare_store`
never waits for a slot (no slot in stock: the chunk is not stored). Every call holds
`_lock`. Must not call the store or the control channel.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from kvstrata.connector.compat import (
    BlockIDsLoadStoreSpec,
    LookupResult,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    key_position,
    key_positions,
    load_source,
    make_event,
    override,
)
from kvstrata.connector.eviction import EvictionOrder
from kvstrata.connector.inbox import ReplyInbox
from kvstrata.connector.manager_state import Pin
from kvstrata.keys import key_group, key_name
from kvstrata.tiers.arena import PoolGeometry
from kvstrata.tiers.changelog import CPU


FIRST_LOOKUP = {LookupResult.HIT: "requests_hit_at_first_lookup", LookupResult.RETRY: "requests_retried_at_first_lookup"}


class ArenaSlotsSpec(BlockIDsLoadStoreSpec):
    """Arena slot numbers of a transfer, with the geometry that locates them.

    Carrying the geometry (a few strings and ints) lets a worker map segments lazily
    without talking to the store, and keeps a transfer valid even if the store restarts.
    """

    def __init__(self, slots: list[int], geometry: PoolGeometry):
        super().__init__(slots)
        self.geometry = geometry


# The state fields this part writes (manager_state.py declares them; tests/connector/
# test_manager_walls.py holds this list to the code, both ways).
WRITES = frozenset({
    "_arrived", "_counters", "_events", "_maybe_idle", "_mirror", "_missed_until", "_out_commit",
    "_out_positions", "_out_release", "_out_unpin", "_pin_waiters", "_pinned", "_purge_requested",
    "_req_keys", "_req_used", "_reset_holds", "_reset_pins", "_reset_releases", "_reset_steps_left",
    "_resets", "_resident", "_stock", "_store_demand", "_store_dropped", "_store_wait_since",
    "_storing", "_to_hold", "_to_pin", "_to_touch", "_trusted", "_view_wanted"
})  # fmt: skip


class PinsAndSlots(ReplyInbox, EvictionOrder, OffloadingManager):
    # --- lookups and loads --------------------------------------------------------

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        with self._lock:
            self._recompute_rate.request_started(req_context.req_id)
            self._hints.on_new_request(req_context)  # hints.py: kv.prefetch / kv.retain / pin
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._lock:
            first = req_context.req_id not in self._arrived  # its first lookup (since it last loaded)
            result = self._answer(key, req_context)
            if first:  # what a request's first lookup found: a HIT, or a wait (RETRY), or nothing
                self._counters[FIRST_LOOKUP.get(result, "requests_missed_at_first_lookup")] += 1
            if result is LookupResult.RETRY:
                self._counters["lookups_retried"] += 1
            elif result is LookupResult.MISS:
                self._recompute_rate.missed(req_context.req_id, key_position(req_context, key))
            return result

    def _answer(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """The answer to one lookup; the caller holds the lock.

        Hot path: most lookups are HITs on a pinned or arena-resident chunk, once per
        chunk per request, on vLLM's scheduler thread. Those take no clock reading past a
        request's first lookup, no chunk position unless the request has a cut, and no
        container they do not keep (benchmarks/manager_overhead.py)."""
        if not self._pass_open:
            # First lookup of a scheduling pass: replies that arrived during the
            # forward pass turn this pass's RETRYs into HITs. (Rule 3, once per pass.)
            self._open_pass()
            self._trusted = self._clock() < self._trusted_until
        req_id = req_context.req_id
        arrived = self._arrived.get(req_id)
        if arrived is None:
            arrived = self._arrived[req_id] = self._clock()
        if self._load_admission.has_cut(req_id) and self._load_admission.cut_before(
            req_id, key_position(req_context, key)
        ):
            return LookupResult.MISS  # this request recomputes from an earlier chunk on
        pin = self._pinned.get(key)
        if pin is not None and pin.epoch == self._epoch and self._trusted:
            pin.requests.add(req_id)
            self._req_keys[req_id].add(key)
            self._note_used(key, req_context)
            return LookupResult.HIT
        if key in self._storing:
            return LookupResult.HIT_PENDING
        slot = self._resident.get(key)
        if slot is not None and pin is None and self._trusted:
            # Resident in the arena: HIT now, as vLLM's own CPU manager answers. The
            # pin goes out with the next control call, before this engine acknowledges
            # any later view; until then deferred slot reuse keeps the slot's bytes.
            # (A promotion this engine asked for may have reached the mirror first.)
            self._pin_for_waiters(key, slot, recorded=False, hit_by=req_id)
            self._to_hold.append((key, slot))
            self._req_keys[req_id].add(key)
            self._note_used(key, req_context)
            self._counters["hits_without_round_trip"] += 1
            return LookupResult.HIT
        now = self._clock()
        position = key_position(req_context, key)
        missed_until = self._missed_until.get(key)
        if missed_until is not None:
            if missed_until > now:
                return LookupResult.MISS  # the store could not bring it a moment ago
            del self._missed_until[key]
        if now - arrived > self._lookup_wait:
            # A slow promotion or a silent store must not hold the request: recompute.
            if key in self._pin_waiters or key in self._mirror or self._view_as_of < arrived - self._max_view_age:
                self._counters["lookups_timed_out"] += 1
                self._load_admission.note_timed_out(req_id)
            return LookupResult.MISS
        if (
            key in self._mirror
            and self._load_admission.undecided(req_id)
            and self._view_as_of < arrived - self._max_view_age
            and not self._store_silent(req_id)
        ):
            # A cut is final for the request: take it on a view as fresh as a MISS needs
            # (the chunk may have been promoted into the arena since this view, 28 Nov 2026:
            # a probed prompt recomputed on a loaded machine).
            self._view_wanted = True
            return LookupResult.RETRY
        if key in self._mirror and self._load_admission.decide(
            req_id, position, key_positions(req_context), self._mirror, self._anchor_groups, key_group, now,
            self._pin_waiters,
        ):  # fmt: skip
            self._probe(self._load_admission.take_probes())
            return LookupResult.MISS  # loading the rest from a lower tier is slower than recomputing it
        if key in self._mirror or (pin is not None and pin.epoch == self._epoch):
            if self._store_silent(req_id):
                return LookupResult.MISS
            waiters = self._pin_waiters.get(key)
            if waiters is not None:
                waiters.add(req_id)
            else:
                self._pin_waiters[key] = {req_id}
                self._to_pin.append(key)  # (a pin held here the store answers again, renewing the proof)
            self._req_keys[req_id].add(key)  # so it stops waiting when it finishes
            return LookupResult.RETRY
        if self._view_as_of < arrived - self._max_view_age and not self._store_silent(req_id):
            self._view_wanted = True
            return LookupResult.RETRY
        return LookupResult.MISS

    def _store_silent(self, req_id: str) -> bool:
        """Whether the request has waited `view_wait_steps` of this engine's steps, and
        `_silence_seconds` (SILENCE_ROUND_TRIPS of the store's usual round trip), on a store
        that has not answered since (for a fresher view or a pin); then it is answered from
        what this engine knows. A store that answers (a promotion on its way, a bucket still
        being listed) is waited for up to `lookup_wait_seconds`.

        Why steps: a request's cost is the steps it sits out; a store that stalls (a long
        call, a hung disk read) must cost each request a few steps at most, however long it
        stalls (issue #37, finding 7). Why also time: an engine whose only requests wait
        ends a step every millisecond or less, sooner than a healthy store answers."""
        since = self._store_wait_since.get(req_id)
        if since is None:
            self._store_wait_since[req_id] = (self._steps, self._clock())
            return False
        steps, began = since
        if self._steps - steps < self._view_wait_steps or self._answered_step > steps:
            return False
        if self._clock() - began < self._silence_seconds:
            return False  # steps of an idle engine come fast: the store's usual answer is not silence
        self._counters["lookups_store_silent"] += 1
        return True

    def _probe(self, keys: list[bytes]) -> None:
        """Ask the store to promote `keys` with no request waiting on them: its reads
        measure their tier again. Their pins come back with no request and are released
        at the step's end, like any idle pin; a chunk already asked for or pinned is left."""
        for key in keys:
            if key not in self._pin_waiters and key not in self._pinned:
                self._pin_waiters[key] = set()
                self._to_pin.append(key)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        """The tier a HIT was loaded from (vLLM 0.32+ reports it per request)."""
        with self._lock:
            pin = self._pinned.get(key)
            promoted = pin is not None and req_context.req_id in pin.promoted_for
            return load_source(pin.promoted_from if promoted else CPU)

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> ArenaSlotsSpec:
        with self._lock:
            self._arrived.pop(req_context.req_id, None)  # its wait is over
            self._store_wait_since.pop(req_context.req_id, None)
            slots: list[int] = []
            for key in keys:
                pin = self._pinned.get(key)
                if pin is None:
                    raise AssertionError(f"kvstrata: prepare_load of chunk {key_name(key)} that was not a HIT")
                pin.loads += 1
                slots.append(pin.slot)
            self._counters["chunks_loaded"] += len(slots)
            return ArenaSlotsSpec(slots, self._geometry)

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        with self._lock:
            self._to_touch.extend(key for key in keys if key in self._mirror)

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        with self._lock:
            for key in keys:
                pin = self._pinned.get(key)
                if pin is not None and pin.loads > 0:
                    pin.loads -= 1
                    pin.requests.discard(req_context.req_id)
                    self._maybe_idle[key] = None
            self._drain_inbox()

    # --- stores ---------------------------------------------------------------------

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        with self._lock:
            self._recompute_rate.storing(
                req_context.req_id, ((key_position(req_context, key), key in self._mirror) for key in keys)
            )
            wanted = []
            for key in dict.fromkeys(keys):
                self._note_used(key, req_context)
                if key in self._mirror:
                    self._to_touch.append(key)  # reused: keep it young in the LRU
                elif key not in self._storing and key not in self._pinned:
                    wanted.append(key)
            if not wanted:
                return PrepareStoreOutput(keys_to_store=[], store_spec=ArenaSlotsSpec([], self._geometry), evicted_keys=[])
            if self._clock() >= self._trusted_until:
                # Rule 3: the store may have ended this engine's lease and handed the
                # stock to another engine; a worker must not write into it.
                self._counters["lease_unproven"] += len(wanted)
                return None
            self._store_demand += len(wanted)
            # Earlier chunks of a prefix are worth more than later ones: keep the head.
            accepted = wanted[: len(self._stock)]
            self._store_dropped += len(wanted) - len(accepted)
            self._counters["stores_dropped_no_slot"] += len(wanted) - len(accepted)
            if not accepted:
                return None
            slots = [self._stock.popleft() for _ in accepted]
            for key, slot in zip(accepted, slots):
                self._storing[key] = slot
            return PrepareStoreOutput(
                keys_to_store=list(accepted),
                store_spec=ArenaSlotsSpec(slots, self._geometry),
                evicted_keys=[],
            )

    @override
    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        with self._lock:
            stored: list[bytes] = []
            for key in keys:
                slot = self._storing.pop(key, None)
                if slot is None:
                    continue  # prepared before a store restart or a reset: nothing to publish
                if success:
                    self._out_commit.append((slot, key))
                    if (position := key_position(req_context, key)) is not None:
                        self._out_positions.append((key, position))
                    if key in self._pinned:
                        # A pin of the chunk arrived meanwhile (a pin asked for before this
                        # store began): keep that one, with its requests and loads, and let
                        # the writer's pin go (found by the simulation: replacing it leaked
                        # the other slot's pin for the engine's lifetime).
                        self._out_unpin.append(slot)
                    else:
                        # The store keeps the writer's pin at commit; we hold it until idle
                        # and the commit's answer gave the mirror its slot (`indexing`).
                        self._pinned[key] = Pin(slot, self._epoch, indexing=True)
                    media = self._mirror.setdefault(key, set())
                    if CPU not in media:
                        media.add(CPU)
                        stored.append(key)
                else:
                    self._out_release.append(slot)
                    self._counters["stores_failed"] += 1
            self._counters["chunks_stored"] += len(stored)
            if stored and self._events is not None:
                self._events.append(make_event(stored, removed=False))
            self._drain_inbox()

    # --- request boundaries and resets --------------------------------------------------

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        with self._lock:
            req_id = req_context.req_id
            self._arrived.pop(req_id, None)
            self._store_wait_since.pop(req_id, None)
            self._load_admission.forget(req_id)
            self._recompute_rate.request_finished(req_id)
            self._hints.on_request_finished(req_context)  # hints.py: actions over its own chunks
            used = self._req_used.pop(req_id, None)
            if used is not None:
                self._touch_tail_first(used)
            for key in self._req_keys.pop(req_id, ()):  # what it held or waited for, no more
                pin = self._pinned.get(key)
                if pin is not None:
                    pin.requests.discard(req_id)
                    self._maybe_idle[key] = None
                waiters = self._pin_waiters.get(key)
                if waiters is not None:
                    waiters.discard(req_id)

    @override
    def reset_cache(self) -> None:
        """vLLM's reset_prefix_cache(reset_connector=True): purge this namespace on the node.

        A slot must not be reused while a job from before the reset may still read it (a
        load) or write it (a store: on CUDA a GPU->host copy may still run): on vLLM 0.33
        pins are unpinned and stores' slots released when vLLM reports the flush
        (`on_reset_flushed`); before 0.33, at the end of the step after the reset (vLLM
        flushes in-flight jobs in that step; with async scheduling, a step later still).
        """
        with self._lock:
            for key, pin in self._pinned.items():
                if pin.epoch != self._epoch:
                    continue
                self._reset_pins.extend([pin.slot] * pin.grants)
                if not pin.recorded:  # its hold still goes out (deferred reuse covers the slot only until then)
                    self._reset_holds.append((key, pin.slot))
            self._pinned.clear()
            self._pin_waiters.clear()
            self._to_pin.clear()
            self._reset_releases.extend(self._storing.values())
            self._storing.clear()
            # Stores done before the reset, not committed yet: their chunks are of the old
            # namespace (the store would purge them right after committing), their slots go back.
            self._out_release.extend(slot for slot, _ in self._out_commit)
            self._out_commit.clear()
            self._reset_steps_left = self._reset_steps
            self._resets += 1
            self._mirror.clear()
            self._resident.clear()
            self._missed_until.clear()
            self._req_keys.clear()
            self._req_used.clear()
            self._purge_requested = True

    def on_reset_flushed(self) -> None:
        """vLLM 0.33: every job in flight at the reset has finished: their slots can go."""
        with self._lock:
            self._reset_steps_left = 0
            self._release_reset_slots()

    def reset_settled(self) -> bool:
        """True once vLLM has flushed every job that was in flight at the last reset
        (0.33: `on_reset_flushed`; before: the step after the reset has ended, one more
        with async scheduling) and what those jobs held is queued for the next request.

        Whoever shuts this manager down after a reset (`WeightGenerations`) must wait for
        this: `release_holder` frees every slot at once, and a slot freed before the flush
        can be handed to another engine while a load still reads it or a store still
        writes it (issue 51, finding 1)."""
        with self._lock:
            return not self._reset_steps_left and not (self._reset_pins or self._reset_holds or self._reset_releases)

    def _release_reset_slots(self) -> None:
        """Unpin and release what a reset kept for the jobs in flight, now flushed; a hold
        not sent yet is dropped instead of sent and undone."""
        for hold in self._reset_holds:
            if hold in self._to_hold:
                self._to_hold.remove(hold)
            else:
                self._out_unpin.append(hold[1])
        self._out_unpin.extend(self._reset_pins)
        self._out_release.extend(self._reset_releases)
        self._reset_pins, self._reset_holds, self._reset_releases = [], [], []
