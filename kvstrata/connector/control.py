"""The control thread: the only place an engine's scheduler process blocks on its store.

The scheduler hands over at most one request per step (`submit`, never blocks). The
thread sends it; requests that arrive while a call is in flight are merged and sent
as one, so a slow store slows the cache, never the scheduler. With nothing to send
for a third of the lease, the thread sends an empty request: that renews the lease
of an idle engine and brings the index mirror up to date.

What to send next and what an answer or a failure does to it is the `Outbox`'s, plain
state without threads or clocks, so the deterministic simulation (`kvstrata.sim`) drives
the same decisions the thread makes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstrata.actors.protocol import StepReply, StepRequest

logger = logging.getLogger(__name__)


class Outbox:
    """The requests of one channel: the one queued for the next call, the one sent.

    Not thread-safe: `ControlChannel` calls it under its condition."""

    def __init__(self) -> None:
        self.queued: StepRequest | None = None
        self.sent: StepRequest | None = None  # sent, not answered yet
        self.sent_at = 0.0  # when `sent` was sent

    def submit(self, request: StepRequest) -> None:
        """Queue a request for the next call; merges with one not yet sent."""
        self.queued = request if self.queued is None else self.queued.merge(request)

    def amend(self, request: StepRequest) -> bool:
        """Merge `request` into the one queued for the next call, if there is one; False if
        nothing is queued (then nothing is sent: the caller keeps what it wanted to say)."""
        if self.queued is None:
            return False
        self.queued = self.queued.merge(request)
        return True

    def busy(self) -> bool:
        """Whether a request waits to be sent."""
        return self.queued is not None

    def take(self, now: float) -> StepRequest | None:
        """The request to send now (the queued one), marked sent; None if there is none."""
        request, self.queued = self.queued, None
        return None if request is None else self.start(request, now)

    def start(self, request: StepRequest, now: float) -> StepRequest:
        """Mark `request` (a heartbeat, when nothing was queued) sent at `now`."""
        self.sent, self.sent_at = request, now
        return request

    def answered(self, done: bool = True) -> None:
        self.sent = None

    def failed(self) -> None:
        """The call failed: the request is dropped (its owner queues again what must go again)."""
        self.sent = None


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
        self._outbox = Outbox()
        self._in_flight = False
        self._stopped = False
        self._failing = False
        self.calls = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, request: StepRequest) -> None:
        """Queue a request for the next call; merges with one not yet sent."""
        with self._cond:
            self._outbox.submit(request)
            self._cond.notify()

    def amend(self, request: StepRequest) -> bool:
        """Merge `request` into the one queued for the next call, if there is one; False if
        nothing is queued (then nothing is sent: the caller keeps what it wanted to say)."""
        with self._cond:
            return self._outbox.amend(request)

    def busy(self) -> bool:
        with self._cond:
            return self._in_flight or self._outbox.busy()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until nothing is queued or in flight (tests and shutdown; never the scheduler)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._in_flight or self._outbox.busy():
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
                if not self._outbox.busy() and not self._stopped:
                    self._cond.wait(self._heartbeat_s)
                if self._stopped:
                    return
                self._in_flight = True
            # The store answers with its state as of some time after this: callbacks get
            # it so the manager knows how fresh its view is. (A heartbeat is built outside
            # the condition: it takes the manager's lock.)
            sent_at = self._clock()
            with self._cond:
                request = self._outbox.take(sent_at)
            if request is None:
                heartbeat = self._heartbeat()
                with self._cond:
                    request = self._outbox.start(heartbeat, sent_at)
            try:
                reply = self._send(request)
            except Exception as exc:  # noqa: BLE001 - any failure of the store is a miss, not a crash
                if not self._failing:
                    logger.warning("kvstrata: node store call failed, serving misses until it answers: %s", exc)
                self._failing = True
                self._on_failure(request, exc, sent_at)
                with self._cond:
                    self._outbox.failed()
            else:
                if self._failing:
                    logger.info("kvstrata: node store answers again")
                self._failing = False
                done = self._on_reply(request, reply, sent_at)
                with self._cond:
                    self._outbox.answered(done is not False)
            finally:
                self.calls += 1
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()
