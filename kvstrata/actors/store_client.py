"""The only code that calls a node store's Ray handle: `RayStoreClient`, each call bounded
by a timeout and its failures one error, `StoreUnavailable` (kvstrata.protocol's
`StoreClient`). Engines, routers, the CLI, Serve's callback, `kvstrata up` and other
nodes' stores (actors/peers.py) all go through it; tests/test_layering.py checks that no
other module calls `.remote` on a store handle. Imports nothing of the store actor, so
the actor's own parts may use it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from kvstrata.protocol import HintAction, Registration, StepReply, StepRequest


class StoreUnavailable(RuntimeError):
    """The node store (or the Ray cluster) cannot be reached."""


class RayStoreClient:
    """Calls to a store actor, each bounded by a timeout (`kvstrata.protocol.StoreClient`):
    the only code that calls a store handle.

    Blocking ones are used only off the scheduling path: by the manager's control thread,
    at worker start-up, by `kvstrata warm` and the CLI. `apply_hints` and `send_prefetch`
    are not waited for; `stats_async` is awaited by routers.
    """

    def __init__(self, handle: Any, timeout_s: float):
        self.handle = handle
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any) -> Any:
        import ray

        try:
            return ray.get(getattr(self.handle, method).remote(*args), timeout=self.timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise StoreUnavailable(f"node store did not answer {method} within {self.timeout_s}s") from None
        except ray.exceptions.RayActorError as exc:
            cause = str(exc).strip().splitlines()[-1] if str(exc).strip() else ""  # e.g. what its constructor raised
            raise StoreUnavailable(f"node store is down ({type(exc).__name__}{': ' + cause if cause else ''})") from None

    def register(
        self,
        holder: str,
        namespace: str,
        slot_bytes: int,
        layout: Mapping[str, object] | None = None,
        watch: bool = False,
        epoch: str = "",
        nonce: str = "",
    ) -> Registration:
        return self._call("register", holder, namespace, slot_bytes, layout, watch, epoch, nonce)

    def step(self, request: StepRequest) -> StepReply:
        return self._call("step", request)

    def release_holder(self, holder: str, epoch: str) -> None:
        self._call("release_holder", holder, epoch)

    def apply_hints(self, namespace: str, actions: Sequence[HintAction]) -> None:
        """KV hints (store/hints.py), sent without waiting: the store answers each with
        an outcome and counts refusals; a hint must never hold the scheduler."""
        self.handle.apply_hints.remote(namespace, list(actions))

    def prefetch(
        self, namespace: str, keys: Sequence[bytes], deadline_s: float = 0.0, lease_s: float | None = None
    ) -> dict[str, int]:
        return self._call("prefetch", namespace, list(keys), deadline_s, lease_s)

    def send_prefetch(
        self, namespace: str, keys: Sequence[bytes], deadline_s: float = 0.0, lease_s: float | None = None
    ) -> None:
        self.handle.prefetch.remote(namespace, list(keys), deadline_s, lease_s)  # not waited for

    def pin_chunks(self, namespace: str, keys: Sequence[bytes]) -> dict[str, int]:
        return self._call("pin_chunks", namespace, list(keys))

    def retain(self, namespace: str, keys: Sequence[bytes], priority: int, ttl_s: float) -> dict[str, int]:
        return self._call("retain", namespace, list(keys), priority, ttl_s)

    def prefetch_holds(self, namespace: str) -> dict[bytes, float]:
        return self._call("prefetch_holds", namespace)

    def prefetch_pending(self, namespace: str) -> int:
        return self._call("prefetch_pending", namespace)

    def ping(self) -> str:
        """The store's epoch, once it answers (a new store maps its arena first)."""
        return self._call("ping")

    def ping_async(self) -> Awaitable[str]:
        """`ping` for an event loop (Serve's replica start-up); the caller bounds its wait."""
        return self.handle.ping.remote()

    def export_chunks_async(self, namespace: str, keys: Sequence[bytes]) -> Any:
        """Another node's store asking this one for chunks (actors/peers.py): a Ray object
        ref of (keys found, their digests, their bytes); the caller bounds its wait."""
        return self.handle.export_chunks.remote(namespace, list(keys))

    def stats(self) -> dict[str, object]:
        return self._call("stats")

    def stats_async(self) -> Awaitable[dict[str, object]]:
        """An awaitable of the store's stats (a Ray object ref); the caller bounds its wait."""
        return self.handle.stats.remote()

    def purge(self, namespace: str | None = None) -> int:
        return self._call("purge", namespace)

    def close(self) -> None:
        """Take the store down on purpose (`kvstrata down`): its arena is unlinked."""
        self._call("close")
