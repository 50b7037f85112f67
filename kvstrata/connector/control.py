"""The control thread: the only place an engine's scheduler process blocks on its store.

The scheduler hands over at most one request per step (`submit`, never blocks). The
thread sends it; requests that arrive while a call is in flight are merged and sent
as one, so a slow store slows the cache, never the scheduler. With nothing to send
for a third of the lease, the thread sends an empty request: that renews the lease
of an idle engine and brings the index mirror up to date.

Exactly once, in order (protocol.py): each request gets the next request id when it is
first sent, and a call that fails or times out is sent again *as itself* until it is
answered; only then does the next request go. Nothing a request carries is ever queued
again behind a later one (issue #37: a failed call's unpin, queued again, overtook a
newer hold of the same slot), and nothing a lost answer granted is lost (the store keeps
the answer to an engine's last request and sends it again).

What to send next and what an answer or a failure does to it is the `Outbox`'s, plain
state without threads or clocks, so the deterministic simulation (`kvstrata._dev.sim`) drives
the same decisions the thread makes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kvstrata.protocol import StepReply, StepRequest

logger = logging.getLogger(__name__)


class Outbox:
    """The requests of one channel: the one queued for the next call, the one sent.

    Invariant: `sent`, once taken, is what goes out until it is answered; request ids
    grow in the order requests are sent. Not thread-safe: `ControlChannel` calls it under
    its condition."""

    def __init__(self) -> None:
        self.queued: StepRequest | None = None
        self.sent: StepRequest | None = None  # sent, not answered yet
        self.sent_at = 0.0  # when `sent` was first sent: the store applied it after this
        self._last_rid = 0

    def submit(self, request: StepRequest) -> None:
        """Queue a request for the next call, with the next request id (its `rid` is set
        here); merges with one not yet sent (the merge keeps the later id)."""
        self._last_rid += 1
        request.rid = self._last_rid
        self.queued = request if self.queued is None else self.queued.merge(request)

    def busy(self) -> bool:
        """Whether a request waits to be sent or answered."""
        return self.queued is not None or self.sent is not None

    def take(self, now: float) -> StepRequest | None:
        """The request to send now: the unanswered one again, else the queued one (marked
        sent); None if there is neither."""
        if self.sent is None and self.queued is not None:
            self.sent, self.queued, self.sent_at = self.queued, None, now
        return self.sent

    def start(self, heartbeat: StepRequest, now: float) -> StepRequest:
        """Mark a heartbeat (built while nothing was queued) sent at `now`; a request queued
        meanwhile goes with it, after it (ids only grow in the order requests are sent)."""
        if self.queued is not None:
            heartbeat, self.queued = heartbeat.merge(self.queued), None
        else:
            self._last_rid += 1
            heartbeat.rid = self._last_rid
        self.sent, self.sent_at = heartbeat, now
        return heartbeat

    def answered(self, done: bool = True) -> None:
        """The store answered `sent`; `done` False: the answer could not be used yet (the
        engine must register again first): the same request goes again."""
        if done:
            self.sent = None

    def failed(self) -> None:
        """The call failed or timed out: `sent` goes again, as itself (the store may have
        applied it: a repeat is answered with the answer it kept)."""


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
            # the condition; it takes none of the scheduler's locks, #49.)
            now = self._clock()
            with self._cond:
                request = self._outbox.take(now)
            if request is None:
                heartbeat = self._heartbeat()
                with self._cond:
                    request = self._outbox.start(heartbeat, now)
            sent_at = self._outbox.sent_at
            again = False
            try:
                reply = self._send(request)
            except Exception as exc:  # noqa: BLE001 - any failure of the store is a miss, not a crash
                if not self._failing:
                    logger.warning("kvstrata: node store call failed, serving misses until it answers: %s", exc)
                self._failing = True
                self._on_failure(request, exc, sent_at)
                again = True
            else:
                if self._failing:
                    logger.info("kvstrata: node store answers again")
                self._failing = False
                again = self._on_reply(request, reply, sent_at) is False
                with self._cond:
                    self._outbox.answered(not again)
            finally:
                self.calls += 1
                with self._cond:
                    self._in_flight = False
                    self._cond.notify_all()
            if again:  # the same request goes again, after a pause (a store that is down fails fast)
                with self._cond:
                    if not self._stopped:
                        self._cond.wait(self._heartbeat_s)
