"""The store's replies: recorded on the control thread, applied on the scheduler's.

The control thread calls `_receive_reply` / `_receive_failure` with each answer to a
step request; they append to `_inbox` under `_handoff`, a lock held only for that
(and, when the store restarted or this engine's lease ran out, register again first: a
blocking call, but on the control thread). The control thread never takes `_lock`, the
lock the scheduler's calls take (#49: on a busy machine a control thread that held it
to apply a reply, then waited for the GIL or the CPU, stalled the scheduler's lookups).
The scheduler thread applies what arrived at safe points: the first lookup of a pass
(`_open_pass`), completion callbacks and the end of a step (`_drain_inbox`); never
between a `lookup` that said HIT and the `prepare_load` that follows it in one pass.

Applying writes the mirror and its freshness, how long this engine can prove its lease,
what the store granted or refused (stock, reservations, pins, promotions), operations to
send again, events, counters, and after a restart the epoch and geometry: `WRITES` below
lists every field (a test holds the list to the code). Receiving writes only `_inbox`,
`_recv_seq` and `_pass_seq` (under `_handoff`, with `_pass_open`).

Invariants: a reply to a request of an older epoch changes nothing but counters; a
failed call changes nothing but counters (the channel sends the same request again, and
the store applies a request once: protocol.py); a store restart or a lost lease drops
every pin but those with a load in flight (rule 1) and every slot and queued operation
of the old epoch; deferred slot reuse: no request acknowledges a view newer than the one
the engine's HITs are answered from, unless no pass is open and that view is in the
inbox (the next pass applies it before its first HIT); rule 2: the scheduler never waits
on the store, nor on the control thread beyond a `_handoff` list swap. Must not send
requests: what the replies ask for goes out with the next step.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from kvstrata.protocol import Registration, StepReply, StepRequest
from kvstrata.store.registration_check import public_epoch
from kvstrata.connector.compat import make_event
from kvstrata.connector.manager_state import (
    SILENCE_FLOOR_SECONDS,
    SILENCE_ROUND_TRIPS,
    VIEW_AGE_ROUND_TRIPS,
    ManagerState,
    Pin,
)
from kvstrata.tiers.changelog import CPU, OBJECT, PEER, STORAGE

MISSED_PRUNE_AT = 4096  # recent misses kept before the expired ones are dropped

logger = logging.getLogger(__name__)
NOBODY: frozenset[str] = frozenset()  # `Pin.promoted_for` where no request waited on a promotion


# The state fields this part writes (manager_state.py declares them; tests/connector/
# test_manager_walls.py holds this list to the code, both ways).
WRITES = frozenset({
    "_answered_step", "_counters", "_epoch", "_events", "_geometry", "_half_lease", "_inbox",
    "_max_view_age", "_maybe_idle", "_mirror", "_missed_until", "_out_commit", "_out_release",
    "_out_unpin", "_pass_open", "_pass_seq", "_pin_waiters", "_pinned", "_promoted", "_recv_seq",
    "_reserve_cap", "_reserve_outstanding", "_reserve_target", "_reset_holds", "_reset_pins",
    "_reset_releases", "_resident", "_round_trips", "_seq", "_silence_seconds", "_stock",
    "_storing", "_thread_epoch", "_to_hold", "_to_pin", "_to_touch", "_trusted_until", "_view_as_of"
})  # fmt: skip


class ReplyInbox(ManagerState):
    def _adopt(self, registration: Registration, as_of: float) -> None:
        # A view that may lack the bucket's chunks never counts as fresh: lookups RETRY
        # (at most lookup_wait_seconds) until a reply says the store has listed it.
        self._view_as_of = as_of if registration.indexed else float("-inf")
        if registration.lease_seconds:
            self._half_lease = registration.lease_seconds / 2  # the store's lease rules
        self._trusted_until = as_of + self._half_lease
        self._epoch = registration.epoch
        self._geometry = registration.geometry
        self._seq = registration.seq
        self._mirror = {}
        self._apply_changes(registration.changes, registration.slots, snapshot=True, emit=False)

    # Called on the control thread: it takes `_handoff`, never `_lock`.
    def _receive_reply(self, request: StepRequest, reply: StepReply, sent_at: float) -> bool:
        """Record the store's answer; False if it cannot be used yet (registering again
        failed): the channel sends the same request again, and its answer brings us here."""
        if reply.stale:
            return True  # a late repeat of an older call: its answer went long ago
        if reply.epoch != self._thread_epoch:
            sent_at = self._clock()
            try:
                registration = self._client.register(
                    self.holder, self.namespace, self.layout.slot_bytes, self.layout.describe(), True,
                    self._thread_epoch, self._nonce,
                )  # fmt: skip
            except Exception as exc:  # noqa: BLE001
                self._receive_failure(request, exc, sent_at)
                return False
            self._thread_epoch = registration.epoch
            logger.warning(
                "kvstrata manager %s: node store restarted or this engine's lease ran out (now epoch %s); "
                "dropping old pins and slots",
                self.holder,
                public_epoch(registration.epoch),  # the holder's token stays out of logs
            )
            self._receive(("reset", request, registration, sent_at, 0.0))
            return True
        self._receive(("reply", request, reply, sent_at, self._clock() - sent_at))
        return True

    def _receive_failure(self, request: StepRequest, exc: Exception, sent_at: float) -> None:
        self._receive(("failure", request, exc, sent_at, 0.0))

    def _pin_for_waiters(self, key: bytes, slot: int, recorded: bool = True, hit_by: str | None = None) -> Pin:
        """A new local pin of `key` at `slot` for the requests that waited on it, with the
        tier a promotion they asked for brought it from (what vLLM reports as the source),
        and for `hit_by`, a request that found it in the arena (not promoted for it).

        Each waiter has the key in `_req_keys` since its lookup (pins.py), so it lets go
        when it finishes. A pin no request holds (a background probe's, or every waiter
        finished meanwhile) goes to `_maybe_idle`, released at the step's end."""
        # (Most pins are HITs on arena chunks nobody waited on: no pops, no copies then.)
        waiters = self._pin_waiters.pop(key, None) if self._pin_waiters else None
        promoted_from = self._promoted.pop(key, CPU) if self._promoted else CPU
        if waiters:
            if promoted_from != CPU:  # (a background probe's promotion, waited on by nobody, is no hit)
                self._counters["chunks_promoted"] += 1
            requests, promoted_for = set(waiters), frozenset(waiters)
        else:
            requests, promoted_for = set(), NOBODY
        if hit_by is not None:
            requests.add(hit_by)
        pin = Pin(slot, self._epoch, requests, 0, promoted_from, promoted_for, recorded, 1 if recorded else 0)  # (hot path)
        self._pinned[key] = pin
        if not requests:
            self._maybe_idle[key] = None
        return pin

    def _take_holds(self) -> list[tuple[bytes, int]]:
        """The holds of every HIT answered from the mirror so far, for a request that also
        acknowledges `_seq`: the store takes them before the acknowledgement, so a slot it
        evicted meanwhile is not reused under a load that reads it (deferred slot reuse)."""
        holds, self._to_hold = self._to_hold, []
        for key, slot in holds:
            pin = self._pinned.get(key)
            if pin is not None and pin.slot == slot:
                pin.recorded = True
                pin.grants += 1
        return holds

    def _receive(self, entry: tuple[str, StepRequest, Any, float, float]) -> None:
        """Record an answer for the scheduler thread to apply (#49: the control thread
        never takes the scheduler's lock, so a control thread slowed by a busy machine --
        waiting for the GIL, preempted mid-apply -- cannot stall a lookup).

        It also notes the newest view received (`_recv_seq`): an idle engine's heartbeat
        acknowledges it (`_heartbeat_seq`) although nothing applied it yet, because the
        scheduler applies every entry received before its next pass opens, before that
        pass's first HIT (`_open_pass`). Consecutive answers to heartbeats are folded into
        one (`merge_idle_replies`): an engine idle for hours keeps one entry, not 5 a second.
        """
        kind, request, payload = entry[0], entry[1], entry[2]
        with self._handoff:
            if kind == "reset":
                self._recv_seq = self._pass_seq = payload.seq  # a new store's log
            elif kind == "reply" and request.epoch == self._thread_epoch:
                self._recv_seq = max(self._recv_seq, payload.seq)
            last = self._inbox[-1] if self._inbox else None
            merged = merge_idle_replies(last, entry) if last is not None else None
            if merged is not None:
                self._inbox[-1] = merged
            else:
                self._inbox.append(entry)

    def _take_inbox(self, open_pass: bool = False) -> deque[tuple[str, StepRequest, Any, float, float]]:
        """Everything received so far (scheduler thread); `open_pass`: and open a
        scheduling pass in the same breath, so a heartbeat acknowledges no view newer than
        what this pass answers from (`_pass_seq`)."""
        with self._handoff:
            entries, self._inbox = self._inbox, deque()
            if open_pass:
                self._pass_open = True
                self._pass_seq = self._recv_seq
        return entries

    def _close_pass(self) -> None:
        with self._handoff:
            self._pass_open = False

    def _open_pass(self) -> None:
        """The first lookup of a scheduling pass: apply what arrived (replies that came
        during the forward pass turn this pass's RETRYs into HITs). Under `_lock`."""
        self._apply_entries(self._take_inbox(open_pass=True))

    def _drain_inbox(self) -> None:
        """Apply what arrived, at a safe point of the scheduler thread (under `_lock`)."""
        if self._inbox:
            self._apply_entries(self._take_inbox())

    def _apply_entries(self, entries: deque[tuple[str, StepRequest, Any, float, float]]) -> None:
        for kind, request, payload, sent_at, round_trip in entries:
            if kind == "reply":
                self._apply_reply(request, payload, sent_at, round_trip)
            elif kind == "failure":
                self._apply_failure(request, sent_at)
            else:
                self._apply_reset(payload, sent_at)

    def _heartbeat_seq(self) -> int:
        """The view a heartbeat acknowledges (control thread): between passes, the newest
        received (the next pass applies it before its first HIT); during a pass, the one
        the pass opened with (its HITs' holds go out with the step's request, after this)."""
        with self._handoff:
            return self._pass_seq if self._pass_open else self._recv_seq

    def _measure_round_trip(self, seconds: float) -> None:
        """How long the store takes to answer, as a waiting request sees it: the median of
        the recent round trips (one stall does not move it), times SILENCE_ROUND_TRIPS.

        How old a view gets while this engine steps: two of the longest recent round trips
        (the view being replaced was sent one round trip before its successor, which takes
        one more). A view that old is the freshest this engine holds without waiting, so
        it answers a MISS; the median instead made a request wait whenever round trips
        varied (#49: p50 68-120 ms, p90 295-350 ms on a busy machine, every RETRY a view
        older than two medians)."""
        self._round_trips.append(seconds)
        ordered = sorted(self._round_trips)
        usual = ordered[len(ordered) // 2]
        self._silence_seconds = max(SILENCE_FLOOR_SECONDS, SILENCE_ROUND_TRIPS * usual)
        if self._configured_view_age > 0:  # (0: every chunk stored before a request arrived is found)
            self._max_view_age = max(self._configured_view_age, VIEW_AGE_ROUND_TRIPS * ordered[-1])

    def _apply_reply(self, request: StepRequest, reply: StepReply, sent_at: float, round_trip: float) -> None:
        if request.epoch != self._epoch:
            return
        # The store renewed this engine's lease after `sent_at`: it cannot end before
        # `sent_at` plus a lease; HITs from local state stop at half of it (pins.py).
        self._trusted_until = max(self._trusted_until, sent_at + self._half_lease)
        self._answered_step = self._steps
        self._measure_round_trip(round_trip)  # (measured when it arrived, not when applied)
        if reply.indexed:
            self._view_as_of = max(self._view_as_of, sent_at)
        self._reserve_outstanding -= request.reserve
        self._stock.extend(reply.reserved)
        if reply.reserve_cap:
            self._reserve_target = min(self._reserve_target, reply.reserve_cap)
            self._reserve_cap = reply.reserve_cap
        if reply.costs:
            self._load_admission.receive_costs(reply.costs, self._clock())
        if request.resets < self._resets:
            # Built before a reset (vLLM reset_prefix_cache): what it found is of the purged
            # namespace. Its pins go back; its changes come again with the next reply.
            self._out_unpin.extend(reply.pinned.values())
            return
        self._apply_grants(reply.pinned)
        now = self._clock()
        if len(self._missed_until) > MISSED_PRUNE_AT:
            self._missed_until = {key: until for key, until in self._missed_until.items() if until > now}
        for key in reply.missing:
            if self._pin_waiters.pop(key, None):  # (a background probe's miss is nobody's)
                self._counters["pins_missed"] += 1
            # A miss for a while, then asked for again. Its tiers stay as the store's log
            # says: forgetting them here was never corrected (the log sends changes only),
            # so a chunk the bucket still held was neither loaded nor stored again once the
            # tier came back (measured: the object-slow row, #29).
            self._missed_until[key] = now + self._lookup_wait
            self._resident.pop(key, None)
            self._promoted.pop(key, None)
        for key in reply.pending:
            # Being promoted (disk first, else the object store): ask again next step.
            if key in self._pin_waiters:
                self._to_pin.append(key)
                media = self._mirror.get(key, ())
                self._promoted.setdefault(key, next((m for m in (STORAGE, PEER) if m in media), OBJECT))
        self._apply_changes(reply.changes, reply.slots, reply.snapshot, emit=True)
        self._seq = reply.seq
        for slot, key in request.commit:  # answered: the mirror has their slots now (or never will)
            pin = self._pinned.get(key)
            if pin is not None and pin.indexing and pin.slot == slot:
                pin.indexing = False
                self._maybe_idle[key] = None
        refused = sum(reason.startswith("cannot hold") for reason in reply.rejected)
        if refused:
            self._counters["holds_refused"] += refused
            logger.error("kvstrata manager %s: %d HITs lost their slot before their pin arrived", self.holder, refused)
        if reply.rejected:
            logger.warning("kvstrata manager %s: store rejected %d operations: %s", self.holder, len(reply.rejected), reply.rejected[0])

    def _apply_grants(self, pinned: dict[bytes, int]) -> None:
        """Pins the store granted (asked for with `pin`), counted on the local pins: the
        store counts an engine's pins of a slot, and each is released by one unpin."""
        for key, slot in pinned.items():
            held = self._pinned.get(key)
            if held is None:
                self._pin_for_waiters(key, slot)
                continue
            held.requests |= self._pin_waiters.pop(key, set())  # in `_req_keys` since their lookups
            if held.slot != slot or held.epoch != self._epoch:
                self._out_unpin.append(slot)
            else:
                held.grants += 1

    def _apply_changes(
        self, changes: list[tuple[bytes, str, bool]], slots: dict[bytes, int], snapshot: bool, emit: bool
    ) -> None:
        """Fold the store's tier membership changes into the mirror (and the arena slots of
        the chunks it has in the CPU tier); emit them as events."""
        events: dict[tuple[str, bool], list[bytes]] = {}
        if snapshot:
            self._resident = {}
        for key, medium, present in changes:
            if medium != CPU:
                continue
            if present and key in slots:
                self._resident[key] = slots[key]
            else:
                self._resident.pop(key, None)
        if snapshot:
            fresh: dict[bytes, set[str]] = {}
            for key, medium, present in changes:
                if present:
                    fresh.setdefault(key, set()).add(medium)
            for key, media in self._mirror.items():
                for medium in media - fresh.get(key, set()):
                    events.setdefault((medium, True), []).append(key)
            for key, media in fresh.items():
                for medium in media - self._mirror.get(key, set()):
                    events.setdefault((medium, False), []).append(key)
            self._mirror = fresh
        else:
            for key, medium, present in changes:
                media = self._mirror.get(key)
                if present and (media is None or medium not in media):
                    self._mirror.setdefault(key, set()).add(medium)
                    events.setdefault((medium, False), []).append(key)
                elif not present and media is not None and medium in media:
                    media.discard(medium)
                    if not media:
                        del self._mirror[key]
                    events.setdefault((medium, True), []).append(key)
        if emit and self._events is not None:
            for (medium, removed), keys in events.items():
                self._events.append(make_event(keys, removed=removed, medium=medium))

    def _apply_failure(self, request: StepRequest, sent_at: float) -> None:
        """A call failed or timed out: the channel sends the same request again (the store
        applies it once), so nothing it carried is queued again here. Requests waiting on
        the store wait a few steps at most (pins.py: `engine.view_wait_steps`)."""
        self._counters["control_failures"] += 1

    def _apply_reset(self, registration: Registration, as_of: float) -> None:
        # Slots of the old epoch mean nothing to the new store. Loads already prepared
        # keep their geometry and finish from the old segments, which the new store
        # unlinks only after a lease period.
        self._stock.clear()
        self._reserve_outstanding = 0
        self._storing.clear()
        self._pin_waiters.clear()
        self._to_pin.clear()
        self._to_touch.clear()
        self._out_commit.clear()
        self._out_unpin.clear()
        self._out_release.clear()
        self._reset_pins.clear()
        self._reset_releases.clear()
        self._reset_holds.clear()
        self._to_hold.clear()  # the new store never handed out those slots
        self._missed_until.clear()
        for key in [k for k, p in self._pinned.items() if not p.loads]:
            del self._pinned[key]
        for pin in self._pinned.values():
            pin.recorded = True  # of the old epoch: nothing to send, nothing to unpin
            pin.indexing = False  # ... nor a commit to wait for
        self._adopt(registration, as_of)


def merge_idle_replies(
    first: tuple[str, StepRequest, Any, float, float], second: tuple[str, StepRequest, Any, float, float]
) -> tuple[str, StepRequest, Any, float, float] | None:
    """Two consecutive answers to heartbeats (requests with nothing but an acknowledgement,
    answers with nothing but the index's changes) as one, or None if they are not both.

    Applying the result is applying both in order: the later answer's sequence, lease proof
    and view time, and the changes of both, the later one's winning per (key, tier); a
    snapshot starts over (the first's changes before a later snapshot are dropped)."""
    if first[0] != "reply" or second[0] != "reply":
        return None
    (_, req1, rep1, _, _), (_, req2, rep2, sent2, trip2) = first, second
    for request, reply in ((req1, rep1), (req2, rep2)):
        if not request.is_empty() or reply.stale or reply.pinned or reply.missing or reply.pending:
            return None
        if reply.reserved or reply.rejected:
            return None
    if req1.epoch != req2.epoch or req1.resets != req2.resets or rep1.epoch != rep2.epoch:
        return None
    if rep2.snapshot:
        return second
    latest: dict[tuple[bytes, str], bool] = {}
    for key, medium, present in (*rep1.changes, *rep2.changes):
        latest.pop((key, medium), None)  # (re-inserted: the order of the last change)
        latest[(key, medium)] = present
    merged = StepReply(
        epoch=rep2.epoch,
        seq=rep2.seq,
        reserve_cap=rep2.reserve_cap or rep1.reserve_cap,
        changes=[(key, medium, present) for (key, medium), present in latest.items()],
        slots={**rep1.slots, **rep2.slots},
        snapshot=rep1.snapshot,
        indexed=rep2.indexed,
        costs=rep2.costs or rep1.costs,
    )
    return ("reply", req2, merged, sent2, trip2)
