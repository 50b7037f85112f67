"""Where routing decisions can be read back: a small named actor per deployment.

A router runs inside Serve's processes (the ingress replicas that hold a handle to the
LLM deployment); its counters and decision log lines live there. Tests, benchmarks and
operators comparing routers want them in one place: requests per replica, decisions by
kind (an estimate, or a fallback and why), the estimates' parts. Each router sends what
it recorded in batches, at most once per `flush_seconds`, fire-and-forget, to the
deployment's ledger (`kvstrata-routing-<app>-<deployment>` in the `kvstrata` namespace),
which keeps totals and the latest `RECENT` decisions.

Ownership: the first router of a deployment creates the ledger (detached, so it outlives
one ingress replica) and registers it with Serve's controller, which kills it at
`serve.shutdown()`; `drop_ledger` removes it by hand. A ledger that cannot be reached
costs the router nothing but the entries (counted in `lost`).

Invariants: `record` never fails on an entry it does not understand (it counts what it
can); a router never waits on the ledger.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

LEDGER_PREFIX = "kvstrata-routing-"
RECENT = 2000


def ledger_name(app: str, deployment: str) -> str:
    return LEDGER_PREFIX + re.sub(r"[^A-Za-z0-9_.-]", "-", f"{app}-{deployment}")


class RoutingLedger:
    """Totals and the latest decisions of every router of one deployment."""

    def __init__(self) -> None:
        self._recent: deque[dict[str, Any]] = deque(maxlen=RECENT)
        self._decisions: dict[str, int] = {}
        self._replicas: dict[str, dict[str, Any]] = {}

    def record(self, entries: list[dict[str, Any]]) -> None:
        for entry in entries:
            self._recent.append(entry)
            decision = str(entry.get("decision", "unknown"))
            self._decisions[decision] = self._decisions.get(decision, 0) + 1
            replica = str(entry.get("replica", "unknown"))
            totals = self._replicas.setdefault(replica, {"node": entry.get("node"), "requests": 0})
            totals["requests"] += 1
            for figure in ("estimate_seconds", "covered_tokens", "prompt_tokens"):
                value = entry.get(figure)
                if isinstance(value, int | float):
                    totals[figure] = totals.get(figure, 0) + value

    def read(self) -> dict[str, Any]:
        return {"decisions": dict(self._decisions), "replicas": dict(self._replicas), "recent": list(self._recent)}

    def reset(self) -> None:
        self.__init__()


def open_ledger(app: str, deployment: str) -> Any:
    """The deployment's ledger actor, created if it does not exist (blocking: call off the loop)."""
    import ray

    from kvstrata.actors.options import STORE_NAMESPACE

    handle = (
        ray.remote(RoutingLedger)
        .options(name=ledger_name(app, deployment), namespace=STORE_NAMESPACE, lifetime="detached",
                 get_if_exists=True, num_cpus=0, max_restarts=0)  # fmt: skip
        .remote()
    )
    try:  # serve.shutdown() then kills it, as it does Ray's own prefix-tree actor
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        controller._register_shutdown_cleanup_actor.remote(handle)
    except Exception:  # noqa: BLE001 - no Serve here (tests): whoever made it drops it
        pass
    return handle


def read_ledger(app: str, deployment: str) -> dict[str, Any] | None:
    """What the deployment's routers recorded (None: no ledger)."""
    import ray

    from kvstrata.actors.options import STORE_NAMESPACE

    try:
        handle = ray.get_actor(ledger_name(app, deployment), namespace=STORE_NAMESPACE)
    except ValueError:
        return None
    return ray.get(handle.read.remote(), timeout=30)


def drop_ledger(app: str, deployment: str) -> None:
    import ray

    from kvstrata.actors.options import STORE_NAMESPACE

    try:
        ray.kill(ray.get_actor(ledger_name(app, deployment), namespace=STORE_NAMESPACE), no_restart=True)
    except ValueError:
        pass


class LedgerWriter:
    """A router's side: entries batched and sent at most once per `flush_seconds`.

    `open_handle` makes (or finds) the ledger; it runs on a worker thread at the first
    flush. Call `add` from the router's event loop only.
    """

    def __init__(self, open_handle: Callable[[], Any] | None, flush_seconds: float = 1.0):
        self._open = open_handle
        self._handle: Any = None
        self._flush_seconds = flush_seconds
        self._pending: list[dict[str, Any]] = []
        self._scheduled = False
        self.lost = 0

    def add(self, entry: dict[str, Any]) -> None:
        if self._open is None:
            return
        self._pending.append(entry)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_later(self._flush_seconds, self._flush)

    def _flush(self) -> None:
        batch, self._pending, self._scheduled = self._pending, [], False
        if batch:
            asyncio.get_running_loop().run_in_executor(None, self._send, batch)

    def _send(self, batch: list[dict[str, Any]]) -> None:
        try:
            if self._handle is None:
                self._handle = self._open()
            self._handle.record.remote(batch)
        except Exception as exc:  # noqa: BLE001 - the ledger is for reading back, never for routing
            self.lost += len(batch)
            self._handle = None
            logger.debug("kvstrata router: %d ledger entries lost (%s)", len(batch), type(exc).__name__)
