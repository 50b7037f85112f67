"""Joining the Ray cluster and reaching this node's store from any process.

Inside vLLM processes (scheduler, workers) Ray may or may not be initialised already:
Ray Serve LLM initialises it in an anonymous namespace, a plain `vllm serve` does not.
We join with `address="auto"` only when needed, and always name the kvstrata
namespace when looking the store up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any

from kvstrata import ray_address
from kvstrata.actors.node_actor import NodeStoreActor
from kvstrata.actors.options import STORE_NAMESPACE, node_store_options, store_actor_name
from kvstrata.actors.secrets import stash_secrets
from kvstrata.protocol import HintAction, Registration, StepReply, StepRequest
from kvstrata.config import KvstrataConfig

logger = logging.getLogger(__name__)


class StoreUnavailable(RuntimeError):
    """The node store (or the Ray cluster) cannot be reached."""


def join_cluster(address: str = "auto", logging_level: int = logging.INFO) -> None:
    """Connect this process to the Ray cluster unless it already is connected.

    `logging_level`: Ray's own log lines in this process (the CLI passes WARNING: its
    output is kvstrata's answer, not Ray's connection chatter)."""
    import ray

    if ray.is_initialized():
        return
    try:
        ray_address.check(address)  # a dead address fails in seconds, not minutes in ray.init
        ray.init(address=address, namespace=STORE_NAMESPACE, log_to_driver=False, logging_level=logging_level)
    except ray_address.Unreachable as exc:
        raise StoreUnavailable(f"kvstrata needs a running Ray cluster: {exc}") from None
    except ConnectionError as exc:
        raise StoreUnavailable(
            f"kvstrata needs a running Ray cluster on this node and found none at address "
            f"{address!r} ({exc}). Start one with `ray start --head` (or run "
            f"examples/quickstart.py, which starts a local one), or set `ray.address` in the "
            f"kvstrata config / RAY_ADDRESS."
        ) from None
    logger.info("kvstrata joined the Ray cluster (address %s)", address)


def current_node_id() -> str:
    """This process's Ray node. `KVSTRATA_NODE_ID` overrides it: simulated nodes on one
    machine share an IP, and a process that joins the cluster there may be attached to
    another simulated node's raylet than the one it stands for."""
    import ray

    return os.environ.get("KVSTRATA_NODE_ID") or ray.get_runtime_context().get_node_id()


def ensure_node_store(config: KvstrataConfig, node_id: str | None = None) -> Any:
    """The store actor of a node (this one by default), created if it does not exist."""
    import ray

    node_id = node_id or current_node_id()
    actor_cls = ray.remote(NodeStoreActor)
    options = node_store_options(node_id, config.ray.store_num_cpus)
    return actor_cls.options(**options).remote(stash_secrets(config), node_id)  # credentials: not as arguments


def get_node_store(node_id: str | None = None) -> Any:
    """The existing store actor of a node; raises StoreUnavailable if there is none."""
    import ray

    node_id = node_id or current_node_id()
    try:
        return ray.get_actor(store_actor_name(node_id), namespace=STORE_NAMESPACE)
    except ValueError:
        raise StoreUnavailable(f"no kvstrata node store on node {node_id}; run `kvstrata up`") from None


def store_client(node_id: str | None = None, timeout_s: float = 30.0) -> RayStoreClient:
    """A client of a node's existing store (this node's by default); StoreUnavailable if none."""
    return RayStoreClient(get_node_store(node_id), timeout_s)


def named_actors(prefix: str) -> dict[str, Any]:
    """Live kvstrata actors whose name starts with `prefix`, by the rest of their name
    (node ids for stores, shard numbers for the directory)."""
    import ray
    from ray.util import list_named_actors

    found: dict[str, Any] = {}
    for actor in list_named_actors(all_namespaces=True):
        if actor["namespace"] == STORE_NAMESPACE and actor["name"].startswith(prefix):
            try:
                found[actor["name"][len(prefix) :]] = ray.get_actor(actor["name"], namespace=STORE_NAMESPACE)
            except ValueError:
                pass  # ended between the listing and the lookup
    return found


def shutdown_node_store(handle: Any, timeout_s: float = 30.0) -> None:
    """Take a store down on purpose: unlink its segments, then end the actor."""
    import ray

    try:
        ray.get(handle.close.remote(), timeout=timeout_s)
    finally:
        ray.kill(handle, no_restart=True)


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
