"""The engine<->store contract, in one module: the messages, the hint actions, the client.

Everything that crosses between an engine (or a router, `kvstrata warm`, the CLI) and a
node store is declared here: the step and registration messages, the typed KV hint
actions (the one copy of their names), and `StoreClient`, the calls a store answers,
which the Ray client (actors/client.py) and the in-process one (store/local_client.py)
both satisfy. Nothing outside the clients calls a store handle directly.

Step messages: one `StepRequest` per scheduler step at most, never carrying KV bytes: keys, slot
numbers and counts only. Requests merge, so a manager that produced several steps'
worth while a call was in flight sends them as one.

Exactly once, in order: each request an engine sends carries a request id (`rid`), one
more than the last, and the engine sends the next only once the last was answered. A call
that failed or timed out is sent again *as itself* (same id, same content): the store
applies an id once, answers a repeat of its last id with the answer it kept, and ignores
an older id (a timed-out call that Ray ran late). So the store applies an engine's
requests exactly in the order the engine built them, whatever the calls' fates.
"""

from __future__ import annotations

from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from kvstrata.hint_bounds import seconds
from kvstrata.hint_owners import MAX_TAG_CHARS


@dataclass
class StepRequest:
    holder: str
    namespace: str
    # The store epoch the slots in this request belong to; "" = any (heartbeats).
    epoch: str = ""
    known_seq: int = 0
    pin: list[bytes] = field(default_factory=list)
    # (key, slot) of HITs the engine answered from its mirror, with no call to the store:
    # taken as pins *before* `known_seq` is acknowledged (deferred slot reuse).
    hold: list[tuple[bytes, int]] = field(default_factory=list)
    # Resident keys the engine saw reused (offered again, GPU prefix hits): recency only.
    touch: list[bytes] = field(default_factory=list)
    # Each undoes one pin of the slot the engine holds (the store counts an engine's pins
    # of a slot: an unpin of an old pin never undoes a newer one, in any order; #29, #37).
    # Applied after `hold` and `commit`, before `pin`.
    unpin: list[int] = field(default_factory=list)
    commit: list[tuple[int, bytes]] = field(default_factory=list)
    # (key, token its prefix ends at) of committed chunks whose position vLLM recorded:
    # admission.store `chain` writes a prefix's head down (tiers/chain_admission.py).
    positions: list[tuple[bytes, int]] = field(default_factory=list)
    release: list[int] = field(default_factory=list)
    reserve: int = 0
    # Drop every chunk of the namespace (vLLM reset_prefix_cache(reset_connector=True)).
    purge: bool = False
    # The engine's prefill rate (admission.load: configured or measured; 0 = not known):
    # the store only reports it (`kvstrata status`), so it never makes a call worth sending.
    recompute_tokens_per_second: float = 0.0
    # This request's id among the engine's (set when it is queued; 0 = none: applied every
    # time it arrives, and not remembered: tools and tests).
    rid: int = 0
    # How many times the engine had reset its cache when it built this (the store ignores
    # it): the answer to a request built before a reset is of the purged namespace.
    resets: int = 0

    def is_empty(self) -> bool:
        return not (
            self.pin or self.hold or self.touch or self.unpin or self.commit or self.release or self.reserve or self.purge
        )

    def merge(self, later: "StepRequest") -> "StepRequest":
        """Combine two requests in order; slots of an older store epoch are dropped (the
        store commits a request's commits before its purge: those sent with it are older)."""
        if later.epoch != self.epoch:
            return later
        return StepRequest(
            holder=self.holder,
            namespace=self.namespace,
            epoch=self.epoch,
            known_seq=max(self.known_seq, later.known_seq),
            pin=self.pin + later.pin,
            hold=self.hold + later.hold,
            touch=self.touch + later.touch,
            unpin=self.unpin + later.unpin,
            commit=self.commit + later.commit,
            positions=self.positions + later.positions,
            release=self.release + later.release,
            reserve=self.reserve + later.reserve,
            purge=self.purge or later.purge,
            recompute_tokens_per_second=later.recompute_tokens_per_second or self.recompute_tokens_per_second,
            resets=max(self.resets, later.resets),
            rid=max(self.rid, later.rid),
        )


@dataclass
class StepReply:
    epoch: str
    seq: int
    pinned: dict[bytes, int] = field(default_factory=dict)
    # Asked-for pins: gone from every tier (a miss) / being promoted (ask again).
    missing: list[bytes] = field(default_factory=list)
    pending: list[bytes] = field(default_factory=list)
    reserved: list[int] = field(default_factory=list)
    # Most unwritten slots this engine may hold reserved (0: not said).
    reserve_cap: int = 0
    # (key, medium, present) per tier membership change since the engine's `known_seq`.
    changes: list[tuple[bytes, str, bool]] = field(default_factory=list)
    # The arena slot of each key `changes` says is present in the CPU tier.
    slots: dict[bytes, int] = field(default_factory=dict)
    # True: `changes` lists everything present and replaces the engine's mirror.
    snapshot: bool = False
    rejected: list[str] = field(default_factory=list)
    # False while the store's first sweep of the object store for this namespace is still
    # running: chunks already in the bucket may be missing from `changes`, so this view
    # must not turn a lookup into a MISS.
    indexed: bool = True
    # What each lower tier delivers lately: tier -> (latency s, bytes/s, age s) (admission.load).
    costs: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    # True: the answer to a request id older than the last the store applied (a late or
    # repeated call): nothing was applied, nothing here is news.
    stale: bool = False


@dataclass
class Registration:
    """What an engine (manager or worker) learns when it registers a namespace."""

    epoch: str
    node_id: str
    geometry: object  # kvstrata.tiers.arena.PoolGeometry
    seq: int
    changes: list[tuple[bytes, str, bool]]  # everything present, as in a snapshot reply
    slots: dict[bytes, int] = field(default_factory=dict)  # as in StepReply
    indexed: bool = True  # as in StepReply
    # The store's lease: an engine that had no answer for half of it answers no HIT.
    lease_seconds: float = 0.0


# --- KV hint actions -----------------------------------------------------------------------

PREFETCH_ACTION = "kv.prefetch"
RETAIN_ACTION = "kv.retain"
PIN_ACTION = "pin"
UNPIN_ACTION = "unpin"
ACTIONS = (PREFETCH_ACTION, RETAIN_ACTION, PIN_ACTION, UNPIN_ACTION)
HintName = Literal["kv.prefetch", "kv.retain", "pin", "unpin"]
# Keys in one action, and in one batch of actions (one request's: store/hints.py's
# `apply_hints`): a prompt of millions of tokens, not a flood.
MAX_HINT_KEYS = 65536


@dataclass(frozen=True)
class HintAction:
    """One KV hint over chunk keys, as a store applies it (store/hints.py).

    `kv.prefetch` uses `deadline_seconds` and `lease_seconds`, `kv.retain` `priority` and
    `ttl_seconds`; `pin` and `unpin` only the keys. `owner`: the tag of the request that
    sent it (its `cache_salt`, "" without one); the store owns the pins of a batch of hints
    as `request:<owner>` (hint_owners.py), never as the operator's. On the wire (a Ray
    call, Python's `kvstrata.hints`) it travels as the mapping `to_wire` makes.

    Checked here, once, for every action built (the engine) or read from the wire (the
    store): a known name, the keys a list of at most `MAX_HINT_KEYS`, every number finite
    and in range (hint_bounds.py: an integer beyond a double's range is a ValueError, never
    an OverflowError), the owner a string of at most `hint_owners.MAX_TAG_CHARS`. The
    configured maxima (leases, deadlines, TTLs) are the store's to apply (prefetch.py,
    hints.py): they bound the operator's calls too."""

    action: HintName
    keys: list[bytes]
    priority: int | None = None
    ttl_seconds: float | None = None
    lease_seconds: float | None = None
    deadline_seconds: float = 0.0
    owner: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.action, str) or self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r:.40} (known: {', '.join(ACTIONS)})")
        if isinstance(self.keys, (bytes, str)) or not isinstance(self.keys, Sequence):
            raise ValueError(f"an action's keys are a list of chunk keys, got {type(self.keys).__name__}")
        if len(self.keys) > MAX_HINT_KEYS:
            raise ValueError(f"{len(self.keys)} keys in one action; at most {MAX_HINT_KEYS}")
        priority = self.priority
        bad_priority = isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 100
        if priority is not None and bad_priority:
            raise ValueError(f"priority must be an integer 0 to 100, got {priority!r:.40}")
        # Numbers as finite floats (frozen: set through object.__setattr__, once, here).
        object.__setattr__(self, "deadline_seconds", seconds(self.deadline_seconds, "deadline_seconds"))
        if self.lease_seconds is not None:
            object.__setattr__(self, "lease_seconds", seconds(self.lease_seconds, "lease_seconds", positive=True))
        if self.ttl_seconds is not None:
            object.__setattr__(self, "ttl_seconds", seconds(self.ttl_seconds, "ttl_seconds", positive=True))
        if not isinstance(self.owner, str) or len(self.owner) > MAX_TAG_CHARS:
            raise ValueError(f"owner must be a string of at most {MAX_TAG_CHARS} characters, got {self.owner!r:.40}")

    def to_wire(self) -> dict[str, Any]:
        return {
            "action": self.action, "keys": self.keys, "priority": self.priority, "ttl_seconds": self.ttl_seconds,
            "lease_seconds": self.lease_seconds, "deadline_seconds": self.deadline_seconds, "owner": self.owner,
        }  # fmt: skip

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> HintAction:
        """The action a mapping describes; a ValueError (or TypeError) naming what is wrong."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"an action is a mapping, got {type(raw).__name__}")
        deadline = raw.get("deadline_seconds")
        owner = raw.get("owner")
        return cls(  # __post_init__ checks every field
            action=raw.get("action"),  # type: ignore[arg-type]
            keys=raw.get("keys"),  # type: ignore[arg-type]
            priority=raw.get("priority"),
            ttl_seconds=raw.get("ttl_seconds"),
            lease_seconds=raw.get("lease_seconds"),
            deadline_seconds=0.0 if deadline is None else deadline,
            owner="" if owner is None else owner,
        )


# --- the client ----------------------------------------------------------------------------


@runtime_checkable
class StoreClient(Protocol):
    """The calls a node store answers, as engines, routers, `kvstrata warm` and the CLI make
    them. `actors.client.RayStoreClient` (a store actor, each call bounded by a timeout)
    and `store.local_client.LocalStoreClient` (a store in this process) satisfy it.
    Calls raise `StoreUnavailable` (actors/client.py) where the store cannot be reached."""

    # Engines: the control plane.
    def register(
        self,
        holder: str,
        namespace: str,
        slot_bytes: int,
        layout: Mapping[str, object] | None = None,
        watch: bool = False,
        epoch: str = "",
        nonce: str = "",
    ) -> Registration: ...

    def step(self, request: StepRequest) -> StepReply: ...

    def release_holder(self, holder: str, epoch: str) -> None: ...

    def apply_hints(self, namespace: str, actions: Sequence[HintAction]) -> None:
        """Sent without waiting: a hint must never hold the scheduler."""

    # Routers and `kvstrata warm`: moving and keeping chunks.
    def prefetch(
        self, namespace: str, keys: Sequence[bytes], deadline_s: float = 0.0, lease_s: float | None = None
    ) -> dict[str, int]: ...

    def send_prefetch(
        self, namespace: str, keys: Sequence[bytes], deadline_s: float = 0.0, lease_s: float | None = None
    ) -> None:
        """`prefetch`, not waited for (a router must not wait on a store)."""

    def pin_chunks(self, namespace: str, keys: Sequence[bytes]) -> dict[str, int]: ...

    def retain(self, namespace: str, keys: Sequence[bytes], priority: int, ttl_s: float) -> dict[str, int]: ...

    def prefetch_holds(self, namespace: str) -> dict[bytes, float]: ...

    def prefetch_pending(self, namespace: str) -> int: ...

    # Operators: status and purges.
    def ping(self) -> str:
        """The store's epoch: it is up and has mapped its arena."""

    def stats(self) -> dict[str, object]: ...

    def stats_async(self) -> Awaitable[dict[str, object]]:
        """`stats` for an event loop (routers' status figures)."""

    def purge(self, namespace: str | None = None) -> int: ...
