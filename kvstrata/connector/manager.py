"""The scheduler-side manager: vLLM's `OffloadingManager` over a shared node store.

Every answer comes from local state; nothing here blocks on the store. The manager
keeps:
- a mirror of the store's index for this namespace (which keys are resident), fed by
  the replies' change lists, so a cold prompt gets MISS without a round trip -- as long
  as the mirror is no older than its request (`max_view_age_seconds`): an engine that
  sat idle while other engines or the disk cascade changed the store asks once more
  (RETRY) rather than miss chunks that are there;
- the pins it holds (key -> slot), taken through the store, so HIT always means
  "resident and pinned for this engine" and the load cannot fail;
- a stock of free slots reserved in advance, so `prepare_store` never waits.

What it learns in a step goes out in one batched request from `on_schedule_end`; the
control thread sends it. Replies land in an inbox that is applied only at safe points
(the end of a step, and completion callbacks), never between a `lookup` that said HIT
and the `prepare_load` that follows it in the same scheduling pass.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvstrata.actors.protocol import Registration, StepReply, StepRequest
from kvstrata.config import KvstrataConfig
from kvstrata.connector.compat import (
    HAS_RESET_FLUSHED,
    BlockIDsLoadStoreSpec,
    LookupResult,
    OffloadingConnectorStats,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    key_position,
    load_source,
    make_event,
    override,
)
from kvstrata.connector.control import ControlChannel
from kvstrata.connector.metrics import COUNTER_NAMES, GAUGE_NAMES, metric_name, take_stats
from kvstrata.keys import Layout, key_group, key_hash, key_name
from kvstrata.tiers.arena import PoolGeometry
from kvstrata.tiers.changelog import CPU, OBJECT, PEER, STORAGE

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "GAUGE_NAMES", "MAX_RESERVE_TARGET", "ArenaSlotsSpec", "StrataManager", "metric_name"]

# A stock larger than this is hoarding slots other engines on the node could use.
MAX_RESERVE_TARGET = 4096


class ArenaSlotsSpec(BlockIDsLoadStoreSpec):
    """Arena slot numbers of a transfer, with the geometry that locates them.

    Carrying the geometry (a few strings and ints) lets a worker map segments lazily
    without talking to the store, and keeps a transfer valid even if the store restarts.
    """

    def __init__(self, slots: list[int], geometry: PoolGeometry):
        super().__init__(slots)
        self.geometry = geometry


@dataclass
class _Pin:
    slot: int
    epoch: str
    requests: set[str] = field(default_factory=set)
    loads: int = 0
    # Where the chunk came from for the requests that waited on its promotion (all
    # other requests find it in the arena): `STORAGE` (disk) or `OBJECT`.
    promoted_from: str = CPU
    promoted_for: frozenset[str] = frozenset()


class StrataManager(OffloadingManager):
    def __init__(
        self,
        client: Any,
        layout: Layout,
        config: KvstrataConfig,
        holder: str,
        enable_events: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._client = client
        self.layout = layout
        self.namespace = layout.namespace
        self.holder = holder
        self._lock = threading.RLock()
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._reported = dict.fromkeys(COUNTER_NAMES, 0)

        # key -> tiers ("CPU", "STORAGE") of the node store that hold it
        self._mirror: dict[bytes, set[str]] = {}
        self._promoted: dict[bytes, str] = {}  # pins that wait on a promotion -> the tier it reads
        self._pinned: dict[bytes, _Pin] = {}
        self._pin_waiters: dict[bytes, set[str]] = {}  # asked for, not yet answered
        self._to_pin: list[bytes] = []  # asked for, not yet sent
        self._to_touch: list[bytes] = []
        self._storing: dict[bytes, int] = {}  # prepare_store .. complete_store
        self._stock: deque[int] = deque()
        self._reserve_target = config.engine.reserve_slots
        self._reserve_outstanding = 0
        self._reserve_cap = MAX_RESERVE_TARGET  # lowered by the store's answer
        self._req_keys: dict[str, set[bytes]] = {}
        # request -> the chunks it hit or stored, with their token position: touched
        # tail first when it finishes, so the LRU order keeps each prefix's head longest.
        self._req_used: dict[str, dict[bytes, int | None]] = {}
        self._anchor_groups = frozenset(layout.anchor_groups or ())
        self._out_commit: list[tuple[int, bytes]] = []
        self._out_unpin: list[int] = []
        self._out_release: list[int] = []
        self._reset_pins: list[int] = []  # released once vLLM flushed pre-reset loads
        self._purge_requested = False
        self._store_demand = 0
        self._store_dropped = 0
        self._inbox: deque[tuple[str, Any, Any]] = deque()
        self._pass_open = False
        self._refresh_s = config.engine.refresh_seconds
        self._last_submit = 0.0
        self._clock = clock
        self._max_view_age = config.engine.max_view_age_seconds
        self._lookup_wait = config.engine.lookup_wait_seconds
        self._arrived: dict[str, float] = {}  # request -> its first lookup since its last load
        self._view_wanted = False  # a lookup waits for a view newer than the mirror

        asked = clock()
        registration = client.register(holder, self.namespace, layout.slot_bytes, layout.describe())
        self._thread_epoch = registration.epoch
        self._adopt(registration, asked)
        logger.info(
            "kvstrata manager %s: namespace %s, slot %d bytes, %d chunks already resident on node %s",
            holder,
            self.namespace,
            layout.slot_bytes,
            len(self._mirror),
            registration.node_id,
        )
        self._channel = ControlChannel(
            send=client.step,
            on_reply=self._receive_reply,
            on_failure=self._receive_failure,
            heartbeat=self._heartbeat_request,
            heartbeat_s=config.engine.lease_seconds / 3,
            name=f"kvstrata-control-{holder[:8]}",
            clock=clock,
        )
        self._submit(self._take_request())

    # --- vLLM 0.33: callers hold this while they call us --------------------------

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    # --- lookups and loads --------------------------------------------------------

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        with self._lock:
            if not self._pass_open:
                # First lookup of a scheduling pass: replies that arrived during the
                # forward pass turn this pass's RETRYs into HITs.
                self._pass_open = True
                self._drain_inbox()
            req_id = req_context.req_id
            now = self._clock()
            arrived = self._arrived.setdefault(req_id, now)
            pin = self._pinned.get(key)
            if pin is not None and pin.epoch == self._epoch:
                pin.requests.add(req_id)
                self._req_keys.setdefault(req_id, set()).add(key)
                self._note_used(key, req_context)
                return LookupResult.HIT
            if key in self._storing:
                return LookupResult.HIT_PENDING
            if now - arrived > self._lookup_wait:
                # A slow promotion or a silent store must not hold the request: recompute.
                if key in self._pin_waiters or key in self._mirror:
                    self._counters["lookups_timed_out"] += 1
                return LookupResult.MISS
            waiters = self._pin_waiters.get(key)
            if waiters is not None:
                waiters.add(req_id)
                return LookupResult.RETRY
            if key in self._mirror:
                self._pin_waiters[key] = {req_id}
                self._to_pin.append(key)
                return LookupResult.RETRY
            if self._view_as_of < arrived - self._max_view_age:
                self._view_wanted = True
                return LookupResult.RETRY
            return LookupResult.MISS

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
            self._drain_inbox()

    # --- stores ---------------------------------------------------------------------

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        with self._lock:
            wanted = []
            for key in dict.fromkeys(keys):
                self._note_used(key, req_context)
                if key in self._mirror:
                    self._to_touch.append(key)  # reused: keep it young in the LRU
                elif key not in self._storing and key not in self._pinned:
                    wanted.append(key)
            if not wanted:
                return PrepareStoreOutput(keys_to_store=[], store_spec=ArenaSlotsSpec([], self._geometry), evicted_keys=[])
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
                    # The store keeps the writer's pin at commit; we hold it until idle.
                    self._pinned[key] = _Pin(slot, self._epoch)
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

    # --- request and step boundaries ---------------------------------------------------

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        with self._lock:
            req_id = req_context.req_id
            self._arrived.pop(req_id, None)
            self._touch_tail_first(self._req_used.pop(req_id, {}))
            for key in self._req_keys.pop(req_id, ()):
                pin = self._pinned.get(key)
                if pin is not None:
                    pin.requests.discard(req_id)
            for waiters in self._pin_waiters.values():
                waiters.discard(req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        with self._lock:
            self._drain_inbox()
            self._release_idle_pins()
            demand, self._store_demand = self._store_demand, 0
            dropped, self._store_dropped = self._store_dropped, 0
            if dropped:
                # The stock ran dry this step: keep enough for a step like this one.
                self._reserve_target = min(self._reserve_cap, max(2 * self._reserve_target, demand))
            self._pass_open = False
            request = self._take_request()
            # Even with nothing to say, ask now and then: the reply refreshes the index
            # mirror, so chunks other engines stored become hits. Calls never pile up:
            # the channel merges requests while one is in flight.
            now = self._clock()
            if not request.is_empty() or self._view_wanted or now - self._last_submit >= self._refresh_s:
                self._submit(request)

    @override
    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._pin_waiters or self._inbox or self._view_wanted)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        with self._lock:
            if not self._events:
                return []
            events, self._events = self._events, []
            return events

    @override
    def reset_cache(self) -> None:
        """vLLM's reset_prefix_cache(reset_connector=True): purge this namespace on the node.

        A slot must not be reused while a load from before the reset may still read it:
        on vLLM 0.33 pins are released when vLLM reports the flush (`on_reset_flushed`);
        before 0.33, one step late (vLLM flushes in-flight jobs in the next step).
        """
        with self._lock:
            self._reset_pins.extend(p.slot for p in self._pinned.values() if p.epoch == self._epoch)
            self._pinned.clear()
            self._pin_waiters.clear()
            self._to_pin.clear()
            self._out_release.extend(self._storing.values())
            self._storing.clear()
            self._mirror.clear()
            self._req_keys.clear()
            self._req_used.clear()
            self._purge_requested = True

    def on_reset_flushed(self) -> None:
        with self._lock:
            self._out_unpin.extend(self._reset_pins)
            self._reset_pins = []

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._lock:
            gauges = {"reserved_slots": len(self._stock), "pinned_chunks": len(self._pinned)}
            return take_stats(self._counters, self._reported, gauges)

    @override
    def shutdown(self) -> None:
        """Give every pin and reserved slot back at once instead of waiting for the lease."""
        self._channel.close()
        try:
            self._client.release_holder(self.holder)
        except Exception as exc:  # noqa: BLE001 - the lease frees them anyway
            logger.warning("kvstrata manager %s: could not release its slots at shutdown: %s", self.holder, exc)

    # --- introspection (tests, tools) -------------------------------------------------

    def counters(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counters)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until the store answered everything sent; applies the answers. Never used by vLLM."""
        done = self._channel.wait_idle(timeout_s)
        with self._lock:
            self._drain_inbox()
        return done

    # --- internals ----------------------------------------------------------------------

    def _adopt(self, registration: Registration, as_of: float) -> None:
        # A view that may lack the bucket's chunks never counts as fresh: lookups RETRY
        # (at most lookup_wait_seconds) until a reply says the store has listed it.
        self._view_as_of = as_of if registration.indexed else float("-inf")
        self._epoch = registration.epoch
        self._geometry: PoolGeometry = registration.geometry
        self._seq = registration.seq
        self._mirror = {}
        self._apply_changes(registration.changes, snapshot=True, emit=False)

    def _take_request(self) -> StepRequest:
        want = self._reserve_target - len(self._stock) - self._reserve_outstanding
        request = StepRequest(
            holder=self.holder,
            namespace=self.namespace,
            epoch=self._epoch,
            known_seq=self._seq,
            pin=self._to_pin,
            touch=self._to_touch,
            unpin=self._out_unpin,
            commit=self._out_commit,
            release=self._out_release,
            reserve=max(0, want),
            purge=self._purge_requested,
        )
        self._reserve_outstanding += request.reserve
        self._to_pin, self._to_touch = [], []
        self._out_unpin, self._out_commit, self._out_release = [], [], []
        if not HAS_RESET_FLUSHED:
            self._out_unpin.extend(self._reset_pins)
            self._reset_pins = []
        self._purge_requested = False
        return request

    def _heartbeat_request(self) -> StepRequest:
        with self._lock:
            return StepRequest(holder=self.holder, namespace=self.namespace, epoch=self._epoch, known_seq=self._seq)

    def _submit(self, request: StepRequest) -> None:
        self._view_wanted = False
        self._last_submit = self._clock()
        self._channel.submit(request)

    def _note_used(self, key: bytes, req_context: ReqContext) -> None:
        used = self._req_used.setdefault(req_context.req_id, {})
        if key not in used:
            used[key] = key_position(req_context, key)

    def _touch_tail_first(self, used: dict[bytes, int | None]) -> None:
        """Touch a finished request's chunks from its tail to its head, as vLLM's own CPU
        LRU does: a prefix's later chunks (useless without the earlier ones) leave first.
        At one position, the anchor (full-attention) chunk is touched last: a window or
        a state is worth less than the chunk every longer prefix needs.

        Without positions (vLLM < 0.32) a chunk's rank is where its block hash first
        appeared: vLLM offers a request's chunks group by group, each in prefix order,
        and every group's chunk at a position shares that position's hash.
        """
        first_seen: dict[bytes, int] = {}
        for key in used:
            first_seen.setdefault(key_hash(key), len(first_seen))

        def rank(key: bytes) -> tuple[int, bool]:
            position = used[key]
            return (-(first_seen[key_hash(key)] if position is None else position), key_group(key) in self._anchor_groups)

        self._to_touch.extend(key for key in sorted(used, key=rank) if key in self._mirror)

    def _release_idle_pins(self) -> None:
        for key, pin in list(self._pinned.items()):
            if pin.requests or pin.loads:
                continue
            del self._pinned[key]
            if pin.epoch == self._epoch:
                self._out_unpin.append(pin.slot)

    # Called on the control thread: only records, never touches manager state.
    def _receive_reply(self, request: StepRequest, reply: StepReply, sent_at: float) -> None:
        if reply.epoch != self._thread_epoch:
            sent_at = self._clock()
            try:
                registration = self._client.register(
                    self.holder, self.namespace, self.layout.slot_bytes, self.layout.describe()
                )
            except Exception as exc:  # noqa: BLE001
                self._receive_failure(request, exc, sent_at)
                return
            self._thread_epoch = registration.epoch
            logger.warning(
                "kvstrata manager %s: node store restarted (epoch %s); dropping old pins and slots",
                self.holder,
                registration.epoch,
            )
            with self._lock:
                self._inbox.append(("reset", request, registration, sent_at))
            return
        with self._lock:
            self._inbox.append(("reply", request, reply, sent_at))

    def _receive_failure(self, request: StepRequest, exc: Exception, sent_at: float) -> None:
        with self._lock:
            self._inbox.append(("failure", request, exc, sent_at))

    def _drain_inbox(self) -> None:
        while self._inbox:
            kind, request, payload, sent_at = self._inbox.popleft()
            if kind == "reply":
                self._apply_reply(request, payload, sent_at)
            elif kind == "failure":
                self._apply_failure(request, sent_at)
            else:
                self._apply_reset(payload, sent_at)

    def _apply_reply(self, request: StepRequest, reply: StepReply, sent_at: float) -> None:
        if request.epoch != self._epoch:
            return
        if reply.indexed:
            self._view_as_of = max(self._view_as_of, sent_at)
        self._reserve_outstanding -= request.reserve
        self._stock.extend(reply.reserved)
        if reply.reserve_cap:
            self._reserve_target = min(self._reserve_target, reply.reserve_cap)
            self._reserve_cap = reply.reserve_cap
        for key, slot in reply.pinned.items():
            promoted_from = self._promoted.pop(key, CPU)
            if promoted_from != CPU:
                self._counters["chunks_promoted"] += 1
            waiters = self._pin_waiters.pop(key, set())
            for req_id in waiters:  # so a request that ends before its next lookup lets go
                self._req_keys.setdefault(req_id, set()).add(key)
            held = self._pinned.get(key)
            if held is None:
                self._pinned[key] = _Pin(
                    slot, self._epoch, requests=set(waiters), promoted_from=promoted_from, promoted_for=frozenset(waiters)
                )
            else:
                held.requests |= waiters
                if held.slot != slot:
                    self._out_unpin.append(slot)
        for key in reply.missing:
            if key in self._pin_waiters:
                del self._pin_waiters[key]
                self._counters["pins_missed"] += 1
            self._mirror.pop(key, None)
            self._promoted.pop(key, None)
        for key in reply.pending:
            # Being promoted (disk first, else the object store): ask again next step.
            if key in self._pin_waiters:
                self._to_pin.append(key)
                media = self._mirror.get(key, ())
                self._promoted.setdefault(key, next((m for m in (STORAGE, PEER) if m in media), OBJECT))
        self._apply_changes(reply.changes, reply.snapshot, emit=True)
        self._seq = reply.seq
        if reply.rejected:
            logger.warning("kvstrata manager %s: store rejected %d operations: %s", self.holder, len(reply.rejected), reply.rejected[0])

    def _apply_changes(self, changes: list[tuple[bytes, str, bool]], snapshot: bool, emit: bool) -> None:
        """Fold the store's tier membership changes into the mirror; emit them as events."""
        events: dict[tuple[str, bool], list[bytes]] = {}
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
        self._counters["control_failures"] += 1
        if request.epoch != self._epoch:
            return
        # The store could not answer: what we know is all there is, so misses are misses.
        self._view_as_of = max(self._view_as_of, sent_at)
        self._reserve_outstanding -= request.reserve
        # Unpins, releases and commits are idempotent on the store: send them again.
        self._out_unpin.extend(request.unpin)
        self._out_release.extend(request.release)
        self._out_commit.extend(request.commit)
        self._purge_requested |= request.purge
        # Pins we could not get are misses: the engine recomputes instead of waiting.
        for key in request.pin:
            if self._pin_waiters.pop(key, None) is not None:
                self._mirror.pop(key, None)

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
        for key in [k for k, p in self._pinned.items() if not p.loads]:
            del self._pinned[key]
        self._adopt(registration, as_of)
