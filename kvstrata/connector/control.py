"""The control thread: the only place an engine's scheduler process blocks on its store.

The scheduler hands over at most one request per step (`submit`, never blocks). The
thread sends it; requests that arrive while a call is in flight are merged and sent
as one, so a slow store slows the cache, never the scheduler. With nothing to send
for a third of the lease, the thread sends an empty request: that renews the lease
of an idle engine and brings the index mirror up to date.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstrata.actors.protocol import StepReply, StepRequest

logger = logging.getLogger(__name__)


class ControlChannel:
    def __init__(
        self,
        send: Callable[[StepRequest], StepReply],
        on_reply: Callable[[StepRequest, StepReply, float], None],
        on_failure: Callable[[StepRequest, Exception, float], None],
        heartbeat: Callable[[], StepRequest],
        heartbeat_s: float,
        name: str = "kvstrata-control",
        clock: Callable[[], float] = time.monotonic,
    ):
        self._send = send
        self._on_reply = on_reply
        self._on_failure = on_failure
        self._heartbeat = heartbeat
        self._heartbeat_s = heartbeat_s
        self._clock = clock
        self._cond = threading.Condition()
        self._queued: StepRequest | None = None
        self._in_flight = False
        self._stopped = False
        self._failing = False
        self.calls = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: StepRequest) -> None:
        """Queue a request for the next call; merges with one not yet sent."""
        with self._cond:
            self._queued = request if self._queued is None else self._queued.merge(request)
            self._cond.notify()

    def amend(self, request: StepRequest) -> bool:
        """Merge `request` into the one queued for the next call, if there is one; False if
        nothing is queued (then nothing is sent: the caller keeps what it wanted to say)."""
        with self._cond:
            if self._queued is None:
                return False
            self._queued = self._queued.merge(request)
            return True

    def busy(self) -> bool:
        with self._cond:
            return self._in_flight or self._queued is not None

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until nothing is queued or in flight (tests and shutdown; never the scheduler)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight or self._queued is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while True:
            with self._cond:
                if self._queued is None and not self._stopped:
                    self._cond.wait(self._heartbeat_s)
                if self._stopped:
                    return
                request = self._queued
                self._queued = None
                self._in_flight = True
            if request is None:
                request = self._heartbeat()
            # The store answers with its state as of some time after this: callbacks get
            # it so the manager knows how fresh its view is.
            sent_at = self._clock()
            try:
                reply = self._send(request)
            except Exception as exc:  # noqa: BLE001 - any failure of the store is a miss, not a crash
                if not self._failing:
                    logger.warning("kvstrata: node store call failed, serving misses until it answers: %s", exc)
                self._failing = True
                self._on_failure(request, exc, sent_at)
            else:
                if self._failing:
                    logger.info("kvstrata: node store answers again")
                self._failing = False
                self._on_reply(request, reply, sent_at)
            finally:
                self.calls += 1
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()
