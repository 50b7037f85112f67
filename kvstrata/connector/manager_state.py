"""The state of a `StrataManager`, declared in one place for the modules that share it.

A manager is one state machine behind one lock. Its behaviour is split by
responsibility into classes layered over this state, each in its own module:
- `ManagerState` (here): what the manager knows of the store and what it owes it;
- `ReplyInbox` (`inbox`), over the state: the store's replies, recorded, then applied;
- `EvictionOrder` (`eviction`), over the state: touches in LRU order, unpins of idle pins;
- `PinsAndSlots` (`pins`), over both: vLLM's per-request calls (lookups, loads, stores);
- `StrataManager` (`manager`), over that: construction, the step and its request, shutdown.
Counter and gauge names, and the stats vLLM collects, are in `metrics`, which knows
nothing of this state.

Why one state rather than objects owning parts of it: a reply changes the mirror, the
pins, the stock and the outgoing queues together, a reset clears all of them, and a
lookup reads all of them. Split, one transaction would span several objects and their
consistency would rest on call order. Here every field is declared below, and each
part's module declares the fields it writes in `WRITES`, which
tests/connector/test_manager_walls.py holds to the code (AST), both ways.

Invariants every writer keeps:
- rule 1: a HIT's bytes stay put until its load completes. HIT means "pinned for this
  engine", where a pin answered from the mirror is covered by deferred slot reuse until
  its hold reaches the store; a pin with a load in flight (`Pin.loads` > 0) is never
  unpinned: idle-pin release and a store restart keep it, and a reset, which forgets
  every pin, unpins its slot (and releases the slots of stores in flight) only once vLLM
  flushed the jobs that may read or write it. Pins of an old store epoch are forgotten,
  never unpinned (the restarted store unlinks the old segments only after a lease period);
- rule 3: no HIT from the mirror or a pin, and no store into a reserved slot, once the
  last answer of the store is older than half a lease (`_trusted` false): the store
  cannot have ended the lease before a whole one, so what this engine hands its workers
  keeps its slots for at least half a lease;
- rule 2: no blocking call on the scheduling path. Nothing done under `_lock` waits for
  the store: requests go out through the control thread, replies come back into
  `_inbox` and are applied only at safe points, on the scheduler thread (`_drain_inbox`);
  the control thread never takes `_lock` (#49), only `_handoff`, for list swaps;
- every field is read and written under `_lock`, but for `_thread_epoch` (the control
  thread's alone), `_inbox`, `_recv_seq`, `_pass_seq` and `_pass_open` (under `_handoff`;
  `_pass_open` written under both), `_resets` (an int the heartbeat reads), the
  thread-safe `_client` and `_channel`, and what is fixed at construction (`holder`,
  `layout`, `namespace`, `_clock`, the config values).

This module holds data only: it must not call the store, vLLM or another module's code.
"""

from __future__ import annotations

import threading
from collections import defaultdict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvstrata.protocol import StepRequest
from kvstrata.config import KvstrataConfig
from kvstrata.connector.compat import HAS_RESET_FLUSHED, OffloadingEvent
from kvstrata.connector.control import ControlChannel
from kvstrata.connector.load_admission import LoadAdmission
from kvstrata.connector.metrics import COUNTER_NAMES
from kvstrata.connector.recompute_rate import RecomputeRate
from kvstrata.keys import Layout
from kvstrata.tiers.arena import PoolGeometry
from kvstrata.tiers.changelog import CPU

# A stock larger than this is hoarding slots other engines on the node could use.
MAX_RESERVE_TARGET = 4096
# A store is silent to a waiting request (pins.py) after this many of its recent round
# trips (the median of the last ROUND_TRIP_SAMPLES), never sooner than SILENCE_FLOOR_SECONDS.
SILENCE_ROUND_TRIPS = 8
SILENCE_FLOOR_SECONDS = 0.05
ROUND_TRIP_SAMPLES = 16
# A view of the store is fresh enough for a MISS if taken at most `max_view_age_seconds`
# before the request arrived, or this many of the store's longest recent round trips (#49):
# an engine that steps asks every round trip, so its view is up to two round trips old,
# and a busy machine (round trips of 0.1-1 s measured) made every request wait one for
# nothing more than chunks other engines stored in the last round trip.
VIEW_AGE_ROUND_TRIPS = 2


@dataclass(slots=True)
class Pin:
    slot: int
    epoch: str
    requests: set[str] = field(default_factory=set)
    loads: int = 0
    # Where the chunk came from for the requests that waited on its promotion (all
    # other requests find it in the arena): `STORAGE` (disk) or `OBJECT`.
    promoted_from: str = CPU
    promoted_for: frozenset[str] = frozenset()
    # False for a HIT answered from the mirror whose hold has not gone to the store yet.
    recorded: bool = True
    # Pins of the slot the store holds (or will: requests in flight) for this pin: one per
    # hold sent, pin granted, commit; released with one unpin each (the store counts them).
    grants: int = 1
    # A chunk this engine stored whose commit has not been answered yet: kept (not idle)
    # until the answer is applied, so the mirror knows its slot before the pin goes and
    # the next request finds it with no round trip (#49: on a busy machine, the answer
    # came a step or more after the request that stored it had finished).
    indexing: bool = False


@dataclass(slots=True)
class UsedChunks:
    """The chunks one request hit or stored, in first-use order, and vLLM's record of their
    positions (the request's own mapping, read at finish; None before vLLM 0.32)."""

    positions: Mapping[bytes, int] | None
    keys: dict[bytes, None] = field(default_factory=dict)


class ManagerState:
    # Set from the store's registration (`ReplyInbox._adopt`), again after a restart.
    _view_as_of: float  # the mirror is no older than this (-inf: the store is still listing)
    _epoch: str  # the store's epoch the state below belongs to
    _geometry: PoolGeometry
    _seq: int  # the store's change log position the mirror is at
    _thread_epoch: str  # the epoch the control thread registered for (control thread only)
    _channel: ControlChannel  # set by StrataManager once registered
    # Set by StrataManager's constructor.
    _hints: Any  # connector/hints.py's HintIntake: KV hints, bounded
    _nonce: str  # this engine's own secret: a registration whose answer was lost is known as ours

    def __init__(
        self,
        client: Any,
        layout: Layout,
        config: KvstrataConfig,
        holder: str,
        enable_events: bool,
        clock: Callable[[], float],
        async_scheduling: bool = False,
    ):
        self._client = client
        self.layout = layout
        self.namespace = layout.namespace
        self.holder = holder
        self._lock = threading.RLock()
        # The control thread's only lock on this state: held for a list swap or a flag,
        # never while applying or calling anything (inbox.py).
        self._handoff = threading.Lock()
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._counters = dict.fromkeys(COUNTER_NAMES, 0)
        self._reported: dict[str, int] = {}  # empty: the first report sends every counter, zeros too
        # admission.load: break_even -- where each request stops loading (load_admission.py)
        # ... weighed against this engine's prefill rate, measured from its steps (recompute_rate.py)
        self._recompute_rate = RecomputeRate(
            layout.tokens_per_block[0] * layout.blocks_per_chunk, lag=1 if async_scheduling else 0
        )
        self._load_admission = LoadAdmission(
            config.admission,
            config.engine.recompute_tokens_per_second,
            layout.slot_bytes,
            self._counters,
            self._recompute_rate,
        )

        # key -> tiers ("CPU", "STORAGE") of the node store that hold it
        self._mirror: dict[bytes, set[str]] = {}
        # key -> its arena slot, for the keys the mirror has in the CPU tier
        self._resident: dict[bytes, int] = {}
        # (key, slot) of HITs answered from the mirror, not yet sent (deferred slot reuse)
        self._to_hold: list[tuple[bytes, int]] = []
        self._promoted: dict[bytes, str] = {}  # pins that wait on a promotion -> the tier it reads
        # Chunks the store could not bring when asked (a paused tier, no free slot): MISS
        # until then, without asking again; their tiers stay as the store's log says.
        self._missed_until: dict[bytes, float] = {}
        self._pinned: dict[bytes, Pin] = {}
        # Pins that may have become idle since the step began (a request finished, a load
        # completed, a pin arrived or was made with no request): all `_release_idle_pins`
        # looks at, so a step's cost does not grow with the pins running requests hold.
        self._maybe_idle: dict[bytes, None] = {}
        self._pin_waiters: dict[bytes, set[str]] = {}  # asked for, not yet answered
        self._to_pin: list[bytes] = []  # asked for, not yet sent
        self._to_touch: list[bytes] = []
        self._storing: dict[bytes, int] = {}  # prepare_store .. complete_store
        self._stock: deque[int] = deque()
        self._reserve_target = config.engine.reserve_slots
        self._reserve_outstanding = 0
        self._reserve_cap = MAX_RESERVE_TARGET  # lowered by the store's answer
        # request -> the chunks it holds a pin on or waits for: let go when it finishes.
        self._req_keys: defaultdict[str, set[bytes]] = defaultdict(set)
        # request -> the chunks it hit or stored: touched tail first when it finishes, so
        # the LRU order keeps each prefix's head longest.
        self._req_used: dict[str, UsedChunks] = {}
        self._anchor_groups = frozenset(layout.anchor_groups or ())
        self._out_commit: list[tuple[int, bytes]] = []
        self._out_positions: list[tuple[bytes, int]] = []  # (key, end token) of commits: admission `chain`
        self._out_unpin: list[int] = []
        self._out_release: list[int] = []
        self._reset_pins: list[int] = []  # released once vLLM flushed pre-reset loads
        self._purge_requested = False
        self._store_demand = 0
        self._store_dropped = 0
        # (kind, request, reply | failure | registration, sent_at, round trip), appended by the control thread
        self._inbox: deque[tuple[str, StepRequest, Any, float, float]] = deque()
        self._pass_open = False
        # The newest view received (the control thread's; set at registration), and the one
        # the open pass answers from: what a heartbeat acknowledges between / during passes.
        self._recv_seq = 0
        self._pass_seq = 0
        self._refresh_s = config.engine.refresh_seconds
        self._last_submit = 0.0
        self._clock = clock
        self._max_view_age = config.engine.max_view_age_seconds  # stretched to VIEW_AGE_ROUND_TRIPS (inbox.py)
        self._configured_view_age = self._max_view_age
        self._lookup_wait = config.engine.lookup_wait_seconds
        self._arrived: dict[str, float] = {}  # request -> its first lookup since its last load
        self._view_wanted = False  # a lookup waits for a view newer than the mirror
        # request -> the step since which it waits on the store (a fresher view, a pin):
        # at most `engine.view_wait_steps` of its own steps while the store says nothing.
        self._store_wait_since: dict[str, tuple[int, float]] = {}  # (step, clock)
        # ... and longer than the store usually takes to answer (inbox.py measures it): an
        # idle engine ends a step every millisecond or less, a store answers in 1-35 ms.
        self._round_trips: deque[float] = deque(maxlen=ROUND_TRIP_SAMPLES)
        self._silence_seconds = self._lookup_wait  # until a round trip is measured
        self._view_wait_steps = config.engine.view_wait_steps
        self._steps = 0  # scheduler steps ended (on_schedule_end)
        self._answered_step = 0  # `_steps` when the store last answered
        # Rule 3: this engine's lease is proven until `_trusted_until` (its clock): the
        # store renewed it after the last answered request was sent, and ends it a whole
        # lease later at the earliest; `_trusted` is that, read once per scheduling pass.
        self._half_lease = config.engine.lease_seconds / 2
        self._trusted_until = float("-inf")
        self._trusted = False
        # Slots of stores in flight at a reset: released, like `_reset_pins` unpinned, once
        # vLLM flushed the jobs that may write them. vLLM 0.33 says when (`on_reset_flushed`,
        # `_reset_flush_signal`); before, it flushes at the step after the reset, whose end
        # is `_reset_steps_left` steps away (one more with async scheduling).
        self._reset_releases: list[int] = []
        self._reset_holds: list[tuple[bytes, int]] = []  # (key, slot) of reset pins whose hold had not gone
        self._resets = 0  # reset_cache calls: a reply to a request built before the last is of the old namespace
        self._reset_flush_signal = HAS_RESET_FLUSHED
        self._reset_steps_left = 0
        self._reset_steps = 2 if async_scheduling else 1
