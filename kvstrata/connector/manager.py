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

Where the parts live (`manager_state` explains the layering): the state in
`manager_state`, vLLM's per-request calls in `pins`, the replies in `inbox`, the LRU
touches and idle unpins in `eviction`, metric names and stats in `metrics`. This module
owns the rest: registering with the store, the control channel, the step boundary and
the request it sends, events, stats and shutdown. It writes the fields in `WRITES` below
(a test holds the list to the code): chiefly the outgoing queues (handed over to the
request), the stock's target, the step count and the control channel.

Invariants: rule 2 -- the calls that block on the store are construction, `shutdown`
and `wait_idle` (never used by vLLM); every step's request goes through the channel,
at most one per step. `StrataManager`, and the names spec.py and worker.py import from
here (`ArenaSlotsSpec`, the metric names), stay importable from this module. It must
not change the pins, the mirror or the stock itself, only through the other parts'
methods, and imports vLLM names only from `compat`, like every module here.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvstrata.protocol import StepRequest
from kvstrata.config import KvstrataConfig
from kvstrata.connector.compat import (
    OffloadingConnectorStats,
    OffloadingEvent,
    ScheduleEndContext,
    override,
)
from kvstrata.connector.control import ControlChannel
from kvstrata.connector.hints import HintIntake
from kvstrata.connector.manager_state import MAX_RESERVE_TARGET, ManagerState
from kvstrata.connector.metrics import COUNTER_NAMES, GAUGE_NAMES, metric_name, take_stats
from kvstrata.connector.pins import ArenaSlotsSpec, PinsAndSlots
from kvstrata.keys import Layout

logger = logging.getLogger(__name__)

# An idle engine (no scheduler steps) still acknowledges the store's changes this often,
# so slots evicted by busy engines on the node wait at most about this long for it.
IDLE_ACK_SECONDS = 0.2

__all__ = ["COUNTER_NAMES", "GAUGE_NAMES", "MAX_RESERVE_TARGET", "ArenaSlotsSpec", "StrataManager", "metric_name"]


# The state fields this part writes (manager_state.py declares them; tests/connector/
# test_manager_walls.py holds this list to the code, both ways).
WRITES = frozenset({
    "_channel", "_events", "_hints", "_last_submit", "_nonce", "_out_commit", "_out_positions",
    "_out_release", "_out_unpin", "_pass_seq", "_purge_requested", "_recv_seq",
    "_reserve_outstanding", "_reserve_target", "_reset_steps_left", "_steps", "_store_demand",
    "_store_dropped", "_thread_epoch", "_to_pin", "_to_touch", "_view_wanted"
})  # fmt: skip


class StrataManager(PinsAndSlots):
    def __init__(
        self,
        client: Any,
        layout: Layout,
        config: KvstrataConfig,
        holder: str,
        enable_events: bool = False,
        clock: Callable[[], float] = time.monotonic,
        async_scheduling: bool = False,
        channel: Callable[..., ControlChannel] = ControlChannel,
    ):
        """`channel`: builds the control channel (the thread that calls the store); the
        deterministic simulation (`kvstrata._dev.sim`) passes one it drives itself."""
        ManagerState.__init__(self, client, layout, config, holder, enable_events, clock, async_scheduling)
        # KV hints (hints.py), bounded by the `prefetch` section's hint limits
        self._hints = HintIntake(getattr(client, "apply_hints", None), layout, self._counters, config.prefetch)

        # This engine's own secret: registering again after a lost answer is known as ours.
        self._nonce = secrets.token_hex(8)
        asked = clock()
        registration = client.register(holder, self.namespace, layout.slot_bytes, layout.describe(), True, "", self._nonce)
        self._thread_epoch = registration.epoch
        self._adopt(registration, asked)
        # The registration is the first round trip: an engine on a busy machine stretches
        # its view's age (and its silence) from its first request on, not from the first
        # step's answer (#49: a trace's opening requests waited a round trip each).
        self._measure_round_trip(clock() - asked)
        self._recv_seq = self._pass_seq = registration.seq
        logger.info(
            "kvstrata manager %s: namespace %s, slot %d bytes, %d chunks already resident on node %s",
            holder,
            self.namespace,
            layout.slot_bytes,
            len(self._mirror),
            registration.node_id,
        )
        self._channel = channel(
            send=client.step,
            on_reply=self._receive_reply,
            on_failure=self._receive_failure,
            heartbeat=self._heartbeat_request,
            heartbeat_s=min(config.engine.lease_seconds / 3, IDLE_ACK_SECONDS),
            name=f"kvstrata-control-{holder[:8]}",
            clock=clock,
        )
        self._submit(self._take_request())

    # --- vLLM 0.33: callers hold this while they call us --------------------------

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    # --- step boundaries ---------------------------------------------------------------

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
            self._steps += 1
            now = self._clock()
            self._recompute_rate.step_ended(now)
            request = self._take_request()
            # Even with nothing to say, ask now and then: the reply refreshes the index
            # mirror, so chunks other engines stored become hits. Calls never pile up:
            # the channel merges requests while one is in flight.
            if not request.is_empty() or self._view_wanted or now - self._last_submit >= self._refresh_s:
                self._submit(request)
            # Only now, with the pass's holds queued: a heartbeat from here acknowledges the
            # newest view received, and goes out with or after them (inbox.py).
            self._close_pass()

    @override
    def has_pending_work(self) -> bool:
        # Answers not applied yet are no reason to step: a waiting request is (its pin or
        # a fresher view); the rest is applied at the next pass's start, and an idle engine
        # would otherwise step at every heartbeat's answer.
        with self._lock:
            return bool(self._pin_waiters or self._view_wanted)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        with self._lock:
            if not self._events:
                return []
            events, self._events = self._events, []
            return events

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._lock:
            gauges = {
                "reserved_slots": len(self._stock),
                "pinned_chunks": len(self._pinned),
                "recompute_tokens_per_second": round(self._load_admission.recompute_tokens_per_second or 0),
            }
            return take_stats(self._counters, self._reported, gauges)

    @override
    def shutdown(self) -> None:
        """Give every pin and reserved slot back at once instead of waiting for the lease."""
        self._channel.close()
        try:
            self._client.release_holder(self.holder, self._thread_epoch)
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

    # --- the request to the store ----------------------------------------------------------

    def _take_request(self) -> StepRequest:
        want = self._reserve_target - len(self._stock) - self._reserve_outstanding
        holds = self._take_holds()
        request = StepRequest(
            holder=self.holder,
            namespace=self.namespace,
            epoch=self._epoch,
            known_seq=self._seq,
            pin=self._to_pin,
            hold=holds,
            touch=self._to_touch,
            unpin=self._out_unpin,  # (the store counts pins: each unpin undoes one, in any order within a request)
            commit=self._out_commit,
            positions=self._out_positions,
            release=self._out_release,
            reserve=max(0, want),
            purge=self._purge_requested,
            recompute_tokens_per_second=self._load_admission.recompute_tokens_per_second or 0.0,
            resets=self._resets,
        )
        self._reserve_outstanding += request.reserve
        self._to_pin, self._to_touch = [], []
        self._out_unpin, self._out_commit, self._out_release, self._out_positions = [], [], [], []
        if self._reset_steps_left and not self._reset_flush_signal:
            # Before vLLM 0.33: the jobs in flight at a reset are flushed in the step after
            # it; what they may touch goes with the request after that step's.
            self._reset_steps_left -= 1
            if not self._reset_steps_left:
                self._release_reset_slots()
        self._purge_requested = False
        return request

    def _heartbeat_request(self) -> StepRequest:
        """Built on the control thread, without `_lock` (#49): it renews the lease and
        acknowledges a view (`_heartbeat_seq`); it carries no holds (a pass's holds go out
        with its step's request, and no heartbeat acknowledges past them meanwhile)."""
        return StepRequest(
            holder=self.holder, namespace=self.namespace, epoch=self._thread_epoch,
            known_seq=self._heartbeat_seq(), resets=self._resets,
        )  # fmt: skip


    def _submit(self, request: StepRequest) -> None:
        self._view_wanted = False
        self._last_submit = self._clock()
        self._channel.submit(request)
