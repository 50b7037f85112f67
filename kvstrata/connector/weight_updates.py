"""Weights updated in place while an engine serves: a new namespace at every connector reset.

RL frameworks and hot-reloads change an engine's weights without restarting it
(`collective_rpc("reload_weights")`, vLLM's weight-transfer `update_weights`, an NCCL
sync). vLLM 0.29-0.33 tells the connector nothing when weights change; the one signal
it gives is a connector reset, `OffloadingManager.reset_cache()`, which comes from
`reset_prefix_cache(reset_connector=True)` (`POST /reset_prefix_cache?reset_external=true`),
`pause_generation(clear_cache=True)` (its default) and `sleep(level>=1)`. A plain
`reset_prefix_cache()` clears vLLM's own GPU cache only: kvstrata is not told.

A purge of the engine's namespace is not enough to honour the reset: chunks of that
namespace also sit on other nodes (peer fetch), in the bucket, in uploads and
promotions already queued, and in commits of stores that were in flight, and other
engines that still serve the old weights keep adding to it. So a reset ends a
*generation*: from the reset on, the engine's chunks live in a namespace of their own
(`ModelIdentity.updated`: the old identity, the generation and a random part), which
no chunk computed before the reset can be in, here or anywhere. Nothing needs to be
waited for. The old namespace is still purged on this node, as before (it frees the
space; it is not what makes the reset safe).

Invariants:
- after `reset_cache` returns, every answer comes from the new generation's manager;
- the old manager lives until the jobs in flight at the reset can no longer touch its
  slots: it says so (`reset_settled`: on vLLM 0.33 once vLLM reported them flushed,
  `on_reset_flushed`; before, once the step after the reset -- the step whose execution
  flushes them -- has ended, one step later with async scheduling). Then it sends its
  last request (purge, unpins, releases) and shuts down on a thread this object owns;
  its `release_holder` never runs while a pre-reset load may read a slot or a
  pre-reset store may write one;
- a request still running across a reset stores nothing in the new generation: its KV
  was computed, at least in part, with the old weights (vLLM 0.32 re-offloads running
  requests from chunk 0 after a reset, and every later chunk attends to the old KV).
  Recomputing it later is correct; serving it would not be;
- a new generation that cannot be started (the store unreachable) serves misses and
  stores nothing (`Misses`): recomputing is always correct;
- an engine whose first manager is still being built (`deferred_start.py`: the weights'
  fingerprint off the start path) is served by `Starting` until it is; the built one
  takes over at the next request's arrival or step end, the requests `Starting` answered
  for never store in it, and after a reset meanwhile it is not used at all (the weights
  may have changed in place: the generation's own namespace is started instead).
The new namespace is unique to the engine process: engines that applied the same
update do not share it. An engine restarted on the updated checkpoint shares again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Iterable
from typing import Any

from kvstrata.connector.compat import (
    LookupResult,
    OffloadingConnectorStats,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    override,
)
from kvstrata.connector.deferred_start import (
    LOOKUPS_BEFORE_CACHE_ON,
    STORES_BEFORE_CACHE_ON,
    DeferredStart,
    Misses,
    Starting,
)

__all__ = ["Misses", "WeightGenerations"]

logger = logging.getLogger(__name__)

RETIRE_TIMEOUT_S = 5.0


class WeightGenerations(OffloadingManager):
    """vLLM's manager for one engine: the current generation's manager, swapped at each reset.

    `start(generation)` builds the manager of generation `generation` (1, 2, ...): a
    `StrataManager` over the namespace of `ModelIdentity.updated(generation)`.
    `pending`: the first manager is being built (`first` is then a `Starting`).
    """

    def __init__(
        self,
        first: OffloadingManager,
        start: Callable[[int], OffloadingManager],
        pending: DeferredStart | None = None,
    ):
        self._current = first
        self._start = start
        self._pending = pending
        self._generation = 0
        self._live: dict[str, ReqContext] = {}  # requests vLLM started and has not finished
        self._spanning: set[str] = set()  # of those, the ones running when a reset came: never stored again
        self._retiring: list[OffloadingManager] = []  # old generations, oldest first
        self._retired_stats: OffloadingConnectorStats | None = None
        self._threads: list[threading.Thread] = []

    @property
    def current(self) -> OffloadingManager:
        return self._current

    @property
    def generation(self) -> int:
        return self._generation

    def __getattr__(self, name: str) -> Any:  # namespace, holder, counters(), wait_idle(), ... of the current one
        if name.startswith("__") or name == "_current":
            raise AttributeError(name)
        return getattr(self._current, name)

    @property
    def lock(self) -> Any:
        return self._current.lock

    # --- the first manager, built off the start path ----------------------------------------

    @property
    def starting(self) -> bool:
        """Whether the first manager is still being built (lookups MISS, nothing stored)."""
        return self._pending is not None

    def _adopt_first(self) -> None:
        """Put the built first manager in place of `Starting`, if it is ready.

        Called at a request's arrival and at a step's end, on the engine's thread: no call
        of `Starting` is under way, and it holds nothing to hand over."""
        pending = self._pending
        if pending is None or not pending.done:
            return
        self._pending = None
        starting = self._current
        built = pending.take()
        if built is not None and self._generation > 0:
            # A reset came meanwhile: the weights may have changed in place, so the
            # checkpoint's namespace is not this engine's any more.
            self._retire_in_background(built)
            built = self._start_or_misses(self._generation)
        self._current = built if built is not None else Misses()
        assert isinstance(starting, Starting)  # what serves while `_pending` is set
        self._spanning.update(starting.seen)  # their first chunks were never stored
        self._keep_stats(starting)
        for req_context in self._live.values():
            self._current.on_new_request(req_context)
        if not isinstance(self._current, Misses):  # (Starting is one too)
            counters = starting.counters()
            logger.info(
                "kvstrata: cache on for this engine after %.1f s: meanwhile %d lookups answered MISS and %d chunks "
                "not stored", pending.seconds or 0.0, counters[LOOKUPS_BEFORE_CACHE_ON], counters[STORES_BEFORE_CACHE_ON],
            )  # fmt: skip

    # --- the reset ----------------------------------------------------------------------

    @override
    def reset_cache(self) -> None:
        if self._pending is not None:
            # Nothing stored yet; the manager being built serves the checkpoint's namespace,
            # which this engine's weights may have left: `_adopt_first` starts the generation's.
            self._spanning.update(self._live)
            self._generation += 1
            return
        old = self._current
        old.reset_cache()
        self._retiring.append(old)  # retired once it says vLLM flushed the jobs of the reset
        self._spanning.update(self._live)
        self._generation += 1
        self._current = self._start_or_misses(self._generation)
        for req_context in self._live.values():  # requests that go on across the reset
            self._current.on_new_request(req_context)

    def on_reset_flushed(self) -> None:
        for manager in self._retiring:
            flushed = getattr(manager, "on_reset_flushed", None)  # OffloadingManager has it from 0.33 on
            if flushed is not None:
                flushed()

    def _step_retiring(self, context: ScheduleEndContext) -> None:
        """End the step for the old managers too (the first request carries the purge),
        and shut down, off the engine's thread, each one that was settled (vLLM flushed
        the jobs of its reset) before this step: this step's request carries what those
        jobs held, and only then may `release_holder` free the rest."""
        still = []
        for manager in self._retiring:
            settled = _reset_settled(manager)  # read before the step: the request below carries the unpins
            manager.on_schedule_end(context)
            if not settled:
                still.append(manager)
                continue
            self._keep_stats(manager)
            self._retire_in_background(manager)
        self._retiring = still

    def _start_or_misses(self, generation: int) -> OffloadingManager:
        """The manager of `generation`; `Misses` if it cannot be started (the engine keeps
        serving, recomputing)."""
        try:
            return self._start(generation)
        except Exception:  # noqa: BLE001 - the engine keeps serving, recomputing
            logger.exception(
                "kvstrata: could not start a new cache generation; this engine recomputes every prompt until it restarts"
            )
            return Misses()

    def _keep_stats(self, manager: OffloadingManager) -> None:
        """An old manager's last stats, reported with the current one's next (counters add up)."""
        stats = manager.get_stats()
        if stats is not None:
            self._retired_stats = stats if self._retired_stats is None else self._retired_stats.aggregate(stats)

    def _retire_in_background(self, manager: OffloadingManager) -> None:
        """Shut an old manager down on a thread this object owns (`wait_retired`, `shutdown`)."""
        thread = threading.Thread(target=_retire, args=(manager,), name="kvstrata-retire", daemon=True)
        thread.start()
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]

    def wait_retired(self, timeout_s: float = 10.0) -> bool:
        """Wait until every old generation that could retire has shut down. Never used by vLLM."""
        for thread in self._threads:
            thread.join(timeout_s)
        return not any(thread.is_alive() for thread in self._threads)

    # --- delegated to the current generation ------------------------------------------------

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return self._current.lookup(key, req_context)

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        return self._current.prepare_load(keys, req_context)

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._current.touch(keys, req_context)

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self._current.complete_load(keys, req_context)

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        if req_context.req_id in self._spanning:
            return self._current.prepare_store((), req_context)  # "nothing to store": no slot, no warning in vLLM
        return self._current.prepare_store(keys, req_context)

    @override
    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        self._current.complete_store(keys, req_context, success)

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> Any:
        return self._current.get_load_source(key, req_context)

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        if self._pending is not None:
            self._adopt_first()
        self._live[req_context.req_id] = req_context
        return self._current.on_new_request(req_context)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._live.pop(req_context.req_id, None)
        self._spanning.discard(req_context.req_id)
        self._current.on_request_finished(req_context)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        if self._pending is not None:
            self._adopt_first()
        if self._retiring:
            self._step_retiring(context)
        self._current.on_schedule_end(context)

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        events = [event for manager in self._retiring for event in manager.take_events()]
        return events + list(self._current.take_events())

    @override
    def has_pending_work(self) -> bool:
        return bool(self._retiring) or self._current.has_pending_work()

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = self._current.get_stats()
        retired, self._retired_stats = self._retired_stats, None
        if retired is None:
            return stats
        return retired if stats is None else retired.aggregate(stats)  # counters add up, gauges are current

    @override
    def shutdown(self) -> None:
        if self._pending is not None:
            self._pending.close()
            self._pending = None
        for manager in self._retiring:
            _retire(manager)
        self._retiring = []
        for thread in self._threads:
            thread.join(RETIRE_TIMEOUT_S + 1)
        self._current.shutdown()


def _reset_settled(manager: OffloadingManager) -> bool:
    """Whether vLLM flushed the jobs of `manager`'s reset (a manager without slots, such as
    `Misses`, has nothing to wait for)."""
    settled = getattr(manager, "reset_settled", None)
    return True if settled is None else bool(settled())


def _retire(manager: OffloadingManager) -> None:
    """Send what the manager still owes the store (its purge, its unpins), then release the rest."""
    try:
        wait_idle = getattr(manager, "wait_idle", None)
        if wait_idle is not None:
            wait_idle(RETIRE_TIMEOUT_S)
        manager.shutdown()
    except Exception as exc:  # noqa: BLE001 - its lease frees what it held anyway
        logger.warning("kvstrata: an old cache generation did not shut down cleanly: %s", exc)
