"""Route-time prefetch: the chosen node's store starts bringing a request's prefix into its
arena while the request is still on its way (and queued) to the engine.

Why: vLLM loads a request's offloaded KV only once the request is scheduled; a request
queued behind a full batch starts nothing, and its first lookup of a chunk on disk or in
the bucket answers RETRY while the chunk is promoted. The router knows, at routing time,
where the request goes and which of its chunks that node covers: it asks that node's store
(`NodeStore.prefetch`, store/prefetch.py) to move the covered chunks that are not in the
arena and hold them for the request's first lookup, which is then a HIT.

What is asked: per namespace of the chosen node, the prompt's chunk keys up to what the
engine could load (short of the prompt's last token), each group's in prefix order; the
store holds what is resident, moves what is on its disk, a peer or the bucket, stops at
the first chunk no tier holds and skips what `break_even` says to recompute. `deadline_s`
is the router's estimate of the request's time to first token (when its first lookup
happens at the latest); the hold lasts the store's lease past it, so a request that is
cancelled or never arrives costs at most that.

Invariants: never blocks Serve's event loop (the call is made on a thread, and not waited
for); never fails or delays the request: a store that cannot be reached is counted and
logged once per outage. Must not: decide anything about routing.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping
from typing import Any

from kvstrata.protocol import StoreClient
from kvstrata.routing.plan import PromptPlan

logger = logging.getLogger(__name__)


def prefetch_keys(plan: PromptPlan, node_id: str) -> dict[str, list[bytes]]:
    """Namespace -> the chunk keys to prefetch on `node_id`: its namespaces' keys whose
    prefix ends before the prompt's last token (vLLM computes that token itself)."""
    out: dict[str, list[bytes]] = {}
    for namespace, nodes in plan.nodes.items():
        if node_id not in nodes:
            continue
        chunks = plan.chunks[namespace]
        loadable = chunks.loadable_tokens
        keys = [key for key, end in zip(chunks.keys, chunks.ends) if end <= loadable]
        if keys:
            out[namespace] = keys
    return out


class RoutePrefetcher:
    """Sends a routed request's prefetch to its node's store, off the event loop, unwaited."""

    def __init__(self, lease_s: float | None = None, store_of: Any = None):
        """`lease_s`: the hold after the request's expected first lookup (None: the store's
        `prefetch.lease_seconds`); `store_of(node_id)`: the store's client (tests replace it)."""
        self._lease_s = lease_s
        self._store_of = store_of or _store_handle
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()
        self.counters: dict[str, int] = {"sent": 0, "chunks": 0, "failed": 0}
        self._failing = False

    def send(self, node_id: str, keys: Mapping[str, list[bytes]], deadline_s: float) -> None:
        """Ask `node_id`'s store to prefetch `keys` (namespace -> keys) for a request
        expected at its first lookup within `deadline_s`; returns at once."""
        if not keys:
            return
        loop = asyncio.get_running_loop()
        loop.run_in_executor(None, self._send, node_id, dict(keys), max(0.0, deadline_s))

    def _send(self, node_id: str, keys: dict[str, list[bytes]], deadline_s: float) -> None:
        try:
            store = self._handle(node_id)
            for namespace, chunk_keys in keys.items():
                store.send_prefetch(namespace, chunk_keys, deadline_s, self._lease_s)  # not waited for
            with self._lock:
                self.counters["sent"] += 1
                self.counters["chunks"] += sum(len(k) for k in keys.values())
                if self._failing:
                    self._failing = False
                    logger.info("kvstrata router: prefetching on route works again")
        except Exception as exc:  # noqa: BLE001 - a prefetch is advice: the request goes on
            with self._lock:
                self.counters["failed"] += 1
                self._handles.pop(node_id, None)
                if not self._failing:
                    self._failing = True
                    logger.warning("kvstrata router: prefetch on node %s not sent: %s: %s", node_id[:12], type(exc).__name__, exc)

    def _handle(self, node_id: str) -> Any:
        with self._lock:
            handle = self._handles.get(node_id)
        if handle is None:
            handle = self._store_of(node_id)
            with self._lock:
                self._handles[node_id] = handle
        return handle


def _store_handle(node_id: str) -> StoreClient:
    """The node's store client, looked up in the Ray cluster this process is in (never one
    started here: `ray.get_actor` would start a local Ray in a process that has none)."""
    import ray

    from kvstrata.actors.client import store_client

    if not ray.is_initialized():
        raise RuntimeError("this process is not connected to a Ray cluster")
    return store_client(node_id)
