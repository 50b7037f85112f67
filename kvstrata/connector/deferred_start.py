"""An engine that serves at once while kvstrata gets ready: the weights' fingerprint off its start.

Why: a node's first start of a checkpoint reads every byte of it to fingerprint the
weights (`kvstrata.identity`): 43-96 % of vLLM's own cold load of the same checkpoint
(docs/model-identity.md). vLLM builds the connector's manager on its start path (in the
scheduler's constructor), so that read used to delay the engine's first token by as
much. Nothing needs the fingerprint before the first lookup or store, and a miss is
always correct: so where the fingerprint would read more than a few milliseconds' worth
(`identity.LongRead`), the engine starts at once with `Starting` -- every lookup a MISS,
nothing stored, both counted -- while `DeferredStart` computes the fingerprint and
registers the namespace on a thread of its own. `WeightGenerations` puts the manager it
built in place between two of the engine's calls, on the engine's thread. `Off` is the
same kind of manager for good: for an engine whose attention cannot compute over a loaded
prefix (`compat.cached_prefix_unsupported`), where a hit would be a wrong answer.

Invariants:
- before the namespace is known no lookup is a HIT and no chunk is stored: no KV of
  another checkpoint is served, and none of this one is filed under another identity;
- `DeferredStart` owns its thread: after `close`, a manager it builds later is shut
  down at once (its slots released); nothing waits for the read to end (a checkpoint
  being read when the engine stops is read to its end by that daemon thread, then
  dropped).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from kvstrata.connector.compat import (
    LookupResult,
    OffloadingConnectorStats,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    override,
)
from kvstrata.connector.metrics import take_stats
from kvstrata.connector.pins import ArenaSlotsSpec

logger = logging.getLogger(__name__)

# Counters of `Starting` and `Off` (metrics.COUNTER_NAMES documents them).
LOOKUPS_BEFORE_CACHE_ON = "lookups_before_cache_on"
STORES_BEFORE_CACHE_ON = "stores_skipped_before_cache_on"
LOOKUPS_CACHE_OFF = "lookups_cache_off"


class Misses(OffloadingManager):
    """A manager that finds nothing and keeps nothing: the engine recomputes everything."""

    def __init__(self) -> None:
        self._lock = threading.RLock()

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.MISS

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> Any:
        raise AssertionError("prepare_load of a key that was never a HIT")

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        return None

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


def nothing_to_store() -> PrepareStoreOutput:
    """"Nothing to store" rather than None, which vLLM counts as an allocation failure."""
    return PrepareStoreOutput(keys_to_store=[], store_spec=ArenaSlotsSpec([], None), evicted_keys=[])


class CountedMisses(Misses):
    """Misses that count what they turned away and report it as engine metrics."""

    def __init__(self, *counter_names: str) -> None:
        super().__init__()
        self._counters = dict.fromkeys(counter_names, 0)
        self._reported: dict[str, int] = {}

    @override
    def get_stats(self) -> OffloadingConnectorStats | None:
        return take_stats(self._counters, self._reported, {})

    def counters(self) -> dict[str, int]:
        return dict(self._counters)


class Starting(CountedMisses):
    """vLLM's manager until kvstrata is on for the engine: every lookup a MISS, no store.

    It keeps no slot and no pin, so it can be replaced between any two calls. It
    remembers the requests it answered for (`seen`): their first chunks were not stored,
    so the manager that replaces it must not store their later ones either.
    """

    def __init__(self) -> None:
        super().__init__(LOOKUPS_BEFORE_CACHE_ON, STORES_BEFORE_CACHE_ON)
        self.seen: set[str] = set()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self.seen.add(req_context.req_id)
        self._counters[LOOKUPS_BEFORE_CACHE_ON] += 1
        return LookupResult.MISS

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        self.seen.add(req_context.req_id)
        self._counters[STORES_BEFORE_CACHE_ON] += len(keys)
        return nothing_to_store()


class Off(CountedMisses):
    """kvstrata off for good for this engine: its attention cannot compute over a loaded
    prefix (`compat.cached_prefix_unsupported`), so a hit would be a wrong answer. Every
    lookup a MISS (counted), nothing stored."""

    def __init__(self, why: str) -> None:
        super().__init__(LOOKUPS_CACHE_OFF)
        self.why = why

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._counters[LOOKUPS_CACHE_OFF] += 1
        return LookupResult.MISS

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        return nothing_to_store()


class DeferredStart:
    """The engine's first manager, built by `build` on a thread this object owns.

    `take()` hands it over once (None while it is being built); a build that raised hands
    over None with `failed` set, and the engine goes on recomputing (logged once here).
    """

    def __init__(self, build: Callable[[], OffloadingManager], clock: Callable[[], float] = time.monotonic):
        self._build = build
        self._clock = clock
        self._lock = threading.Lock()
        self._built: OffloadingManager | None = None
        self._done = False
        self._closed = False
        self.failed = False
        self.began = clock()
        self.seconds: float | None = None  # how long the build took, once done
        self._thread = threading.Thread(target=self._run, name="kvstrata-identity", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            manager = self._build()
        except Exception:  # noqa: BLE001 - a failed start must not take the engine down
            logger.exception("kvstrata: could not turn the cache on for this engine; it recomputes every prompt")
            with self._lock:
                self._done, self.failed, self.seconds = True, True, self._clock() - self.began
            return
        with self._lock:
            if not self._closed:
                self._built, self._done, self.seconds = manager, True, self._clock() - self.began
                return
        _shut_down(manager)  # the engine stopped meanwhile: release what registering took

    @property
    def done(self) -> bool:
        with self._lock:
            return self._done

    def take(self) -> OffloadingManager | None:
        """The built manager, once (None before it is done, after it was taken, or if it failed)."""
        with self._lock:
            built, self._built = self._built, None
            return built

    def wait(self, timeout_s: float) -> bool:
        """Wait for the build to end (tests, tools); whether it did. Never called by vLLM."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def close(self) -> None:
        """The engine stops: a manager built already or later is shut down, not handed over."""
        with self._lock:
            self._closed = True
            built, self._built = self._built, None
        if built is not None:
            _shut_down(built)


def _shut_down(manager: OffloadingManager) -> None:
    try:
        manager.shutdown()
    except Exception as exc:  # noqa: BLE001 - its lease frees what it held anyway
        logger.warning("kvstrata: a manager built after the engine stopped did not shut down cleanly: %s", exc)
