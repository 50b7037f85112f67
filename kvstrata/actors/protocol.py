"""Control-plane messages between an engine's manager and its node store.

One `StepRequest` per scheduler step at most, never carrying KV bytes: keys, slot
numbers and counts only. Requests merge, so a manager that produced several steps'
worth while a call was in flight sends them as one.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    # Applied after `hold`: a slot both held and unpinned ends unpinned. An unpin that an
    # engine sent *before* holding the slot again must not travel with that hold (see
    # `unpins_before_holds`).
    unpin: list[int] = field(default_factory=list)
    commit: list[tuple[int, bytes]] = field(default_factory=list)
    release: list[int] = field(default_factory=list)
    reserve: int = 0
    # Drop every chunk of the namespace (vLLM reset_prefix_cache(reset_connector=True)).
    purge: bool = False
    # The engine's prefill rate (admission.load: configured or measured; 0 = not known):
    # the store only reports it (`kvstrata status`), so it never makes a call worth sending.
    recompute_tokens_per_second: float = 0.0

    def is_empty(self) -> bool:
        return not (
            self.pin or self.hold or self.touch or self.unpin or self.commit or self.release or self.reserve or self.purge
        )

    def merge(self, later: "StepRequest") -> "StepRequest":
        """Combine two requests in order; slots of an older store epoch are dropped."""
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
            unpin=unpins_before_holds(self.unpin, later.hold) + later.unpin,
            commit=self.commit + later.commit,
            release=self.release + later.release,
            reserve=self.reserve + later.reserve,
            purge=self.purge or later.purge,
            recompute_tokens_per_second=later.recompute_tokens_per_second or self.recompute_tokens_per_second,
        )


def unpins_before_holds(unpin: list[int], hold: list[tuple[bytes, int]]) -> list[int]:
    """`unpin` less the slots that `hold`, sent after it, pins again.

    Why: the store applies a request's holds before its unpins (a hold must come before
    the acknowledgement it guards, and the unpins of HITs released after their hold must
    win). An engine that released a pin and then, from its mirror, answered a new HIT from
    the same slot has an older unpin and a newer hold of that slot; sent together (its
    calls merged while the store was busy, or a failed call's unpins sent again) they
    would leave the slot unpinned under the new HIT's load, and the store could hand it
    to a promotion meanwhile (measured in the fault matrix: a request loaded another
    chunk's bytes, #29). Dropping the unpin keeps the slot pinned throughout, as applying
    the two in order would: the store's pins are one per holder and slot, not counted.
    """
    if not hold or not unpin:
        return unpin
    held = {slot for _, slot in hold}
    return [slot for slot in unpin if slot not in held]


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
