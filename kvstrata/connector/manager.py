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
from collections.abc import Callable, Collection, Iterable
from typing import Any

from kvstrata.actors.protocol import StepRequest
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
    load_source,
    make_event,
    override,
)
from kvstrata.connector.control import ControlChannel
from kvstrata.connector.eviction import EvictionOrder
from kvstrata.connector.inbox import ReplyInbox
from kvstrata.connector.manager_state import MAX_RESERVE_TARGET, ManagerState, Pin
from kvstrata.connector.metrics import COUNTER_NAMES, GAUGE_NAMES, metric_name, take_stats
from kvstrata.keys import Layout, key_name
from kvstrata.tiers.arena import PoolGeometry
from kvstrata.tiers.changelog import CPU

logger = logging.getLogger(__name__)

__all__ = ["COUNTER_NAMES", "GAUGE_NAMES", "MAX_RESERVE_TARGET", "ArenaSlotsSpec", "StrataManager", "metric_name"]

class ArenaSlotsSpec(BlockIDsLoadStoreSpec):
    """Arena slot numbers of a transfer, with the geometry that locates them.

    Carrying the geometry (a few strings and ints) lets a worker map segments lazily
    without talking to the store, and keeps a transfer valid even if the store restarts.
    """

    def __init__(self, slots: list[int], geometry: PoolGeometry):
        super().__init__(slots)
        self.geometry = geometry


class StrataManager(ReplyInbox, EvictionOrder, OffloadingManager):
    _channel: ControlChannel

    def __init__(
        self,
        client: Any,
        layout: Layout,
        config: KvstrataConfig,
        holder: str,
        enable_events: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ):
        ManagerState.__init__(self, client, layout, config, holder, enable_events, clock)

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
                    self._pinned[key] = Pin(slot, self._epoch)
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
