"""Control calls as events: the channel of a simulated engine and the calls it makes.

In production `ControlChannel` runs a thread that sends the manager's requests to the
store, one call at a time. Here the manager gets a `SimChannel` instead (its `channel`
seam): the manager's side is the same (`submit`, `busy`, `wait_idle`, `close`), what to
send next and what a failure means are decided by the same `Outbox` the thread uses, and
every moment of a call is an action the simulation's scheduler picks (`World.act_*`): the
channel sends (`send`), the store applies the call (`deliver`, possibly long after the channel gave
up on it, possibly twice), its answer returns (`answer`) or is lost (`lose`), the channel
gives up waiting (`timeout`), or the call fails at once (`fail`).

Invariants: at most one call of a channel is awaited at a time; a call is applied by the
store at most once per delivery action, and its answer reaches the manager only while the
channel awaits that call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvstrata.protocol import StepReply, StepRequest
from kvstrata.connector.control import Outbox

PENDING, DELIVERED, DONE = "pending", "delivered", "done"


@dataclass(eq=False)
class Call:
    id: int
    engine: int
    request: StepRequest
    sent_at: float
    state: str = PENDING  # pending: not applied yet; delivered: applied, answer on its way; done
    awaited: bool = True  # the channel still waits for this call's answer
    reply: StepReply | None = None
    error: Exception | None = None  # what the store raised instead of answering
    deliveries: int = 0
    channel: "SimChannel | None" = None  # whose call it is (an engine has one per cache generation in flight)


class SimChannel:
    """The manager's control channel, driven by the simulation instead of a thread."""

    def __init__(
        self,
        send: Callable[[StepRequest], StepReply],
        on_reply: Callable[[StepRequest, StepReply, float], object],
        on_failure: Callable[[StepRequest, Exception, float], None],
        heartbeat: Callable[[], StepRequest],
        heartbeat_s: float,
        name: str = "",
        clock: Callable[[], float] = lambda: 0.0,
    ):
        self._on_reply = on_reply
        self._on_failure = on_failure
        self.heartbeat_s = heartbeat_s
        self._clock = clock
        self._heartbeat = heartbeat
        self.outbox = Outbox()
        self.awaiting: Call | None = None
        self.calls = 0  # calls answered or failed, as `ControlChannel.calls`
        self.idle_since = clock()
        self.closed = False

    # --- the manager's side (as ControlChannel) ----------------------------------------

    def submit(self, request: StepRequest) -> None:
        self.outbox.submit(request)

    def busy(self) -> bool:
        return self.awaiting is not None or self.outbox.busy()

    def wait_idle(self, timeout_s: float) -> bool:
        return not self.busy()  # nobody waits in a simulation: the scheduler decides

    def close(self, timeout_s: float = 5.0) -> None:
        self.closed = True

    # --- the channel's decisions, as the simulation drives them ---------------------------

    def next_request(self) -> StepRequest | None:
        """What the channel sends now; None while a call is awaited, or with nothing to say
        and no heartbeat due."""
        if self.closed or self.awaiting is not None:
            return None
        request = self.outbox.take(self._clock())
        if request is None and self._clock() - self.idle_since >= self.heartbeat_s:
            request = self.outbox.start(self._heartbeat(), self._clock())
        return request

    def answered(self, call: Call) -> None:
        self.awaiting = None
        call.awaited = False
        done = self._on_reply(call.request, call.reply, self.outbox.sent_at)
        self.outbox.answered(done is not False)
        self._end()

    def failed(self, call: Call, exc: Exception) -> None:
        self.awaiting = None
        call.awaited = False
        self._on_failure(call.request, exc, self.outbox.sent_at)
        self.outbox.failed()
        self._end()

    def _end(self) -> None:
        self.calls += 1
        self.idle_since = self._clock()
