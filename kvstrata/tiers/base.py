"""What a tier below the arena is to the node store, and the registry of those it can build.

The node store (kvstrata/store/) keeps chunks in the arena and copies them to, and brings
them back from, tiers below it: this node's disk, other nodes' stores (peers), the object
store. Each is a `LowerTier`; the store's cascade, promotion, purges and object index loop
over the configured ones in order and never name one. The order is the promotion order:
a chunk is promoted from the first tier that has it (disk, then peers, then the object
store: the cheapest first), as vLLM's `SecondaryTierManager` tiers are tried in order.

A tier is built by a factory registered here by name (`register_lower_tier`); the store
builds the names it is given, by default those its config enables, in promotion order
(tests plug in an in-memory tier this way, with no edit to the store).

Owns: the protocol, the registry, `LowerTierBase` (no-op defaults for what a tier may lack).
Invariants: every method is called with the arguments it documents; `start_reads` and
`submit_writes` never block on I/O (they queue it) and call `done` exactly once per item,
from any thread, without holding the store lock (`done` takes it); `present` and the
bookkeeping calls run under it.
Must not: import Ray, vLLM or the store (the store's context is handed to factories, untyped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from kvstrata.tiers.arena import SlotPool
    from kvstrata.tiers.retention import RetentionTable

Items = list[tuple[bytes, int]]  # (key, arena slot)
# `done` of a batch of reads or writes (a call may be cut into batches; each gets its own
# `done`): the batch's items, per item whether it arrived (read) or landed (write), and
# the seconds the batch took (reads: what promotion observes in the tier's estimate).
Done = Callable[[Items, list[bool], float], None]


@runtime_checkable
class LowerTier(Protocol):
    """A tier below the arena, as the node store uses it."""

    name: str  # "disk", "peer", "object", ...: promotion source, counters, estimates, reports
    shared: bool  # reaches other nodes: a namespace kept to its node never uses it
    local: bool  # this node's own copy: other nodes' stores may read it through this one (export)
    medium: str  # the change-log medium its presence is recorded as (STORAGE, PEER, OBJECT)
    write_policy: str | None  # "write_through" | "write_back"; None: the cascade never writes it
    holder: str  # the arena pin holder of its copies in flight
    counter: str  # prefix of its copy counters: <counter>_queued, _dropped, _skipped_reuse
    queue_depth: int  # copies in flight at most; more are dropped (never block)

    def available(self) -> bool:
        """Whether it answers now (a paused or failing tier takes no copy and serves no read)."""

    def present(self, namespace: str, keys: Sequence[bytes]) -> set[bytes]:
        """Of `keys`, those its index says it holds (under the store lock); promotion also
        asks `available()` before it reads."""

    def start_reads(self, namespace: str, pool: SlotPool, items: Items, done: Done) -> None:
        """Read `items` into their reserved arena slots in the background."""

    def discard(self, namespace: str, keys: Iterable[bytes]) -> None:
        """Copies read from it that the chunk audit refused: wrong, drop them (under the lock)."""

    def submit_writes(self, namespace: str, pool: SlotPool, items: Items, generation: int, done: Done) -> None:
        """Copy `items` (pinned by `holder`) down in the background; `generation`: the
        namespace's purge generation when queued: a purge since means nothing lands."""

    def read_many(self, namespace: str, chunks: list[tuple[bytes, Any]]) -> list[bool]:
        """Read at once into buffers (another node's store asked: `export_chunks`)."""

    def purge(self, namespace: str, generation: int) -> int:
        """Drop the namespace (under the store lock; long work queued); chunks dropped."""

    def configure(self, namespace: str, anchors: Any, tenant: str | None) -> None:
        """A registration: the namespace's anchor groups and tenant (quotas)."""

    def describe(self, namespace: str, layout: dict[str, object]) -> None:
        """A namespace seen for the first time (the bucket keeps a manifest)."""

    def set_eviction_hints(self, reuse_of: Callable | None = None, retention: RetentionTable | None = None) -> None:
        """What its own eviction should spare: reused chunks (`reuse_of`: estimated uses),
        retained ones (`retention`: the store's table, tiers/retention.py; a tier that keeps
        an order wraps it and listens to the table's changes, at O(1) per record)."""

    def busy(self) -> bool:
        """Whether work it queued is in flight (`wait_io`; under the store lock)."""

    def stats(self) -> dict[str, object] | None: ...

    def shutdown(self) -> None:
        """Stop taking jobs and let those queued end (the store is closing)."""

    def close(self) -> None:
        """Release the tier itself, after every tier's jobs ended."""


class LowerTierBase:
    """Defaults for what a tier may not have: no copies, no bookkeeping, always available."""

    shared = False
    local = False
    write_policy: str | None = None
    holder = ""
    counter = ""
    queue_depth = 0

    def available(self) -> bool:
        return True

    def discard(self, namespace: str, keys: Iterable[bytes]) -> None:
        return None

    def submit_writes(self, namespace: str, pool: SlotPool, items: Items, generation: int, done: Done) -> None:
        done(items, [False] * len(items), 0.0)

    def read_many(self, namespace: str, chunks: list[tuple[bytes, Any]]) -> list[bool]:
        return [False] * len(chunks)

    def purge(self, namespace: str, generation: int) -> int:
        return 0

    def configure(self, namespace: str, anchors: Any, tenant: str | None) -> None:
        return None

    def describe(self, namespace: str, layout: dict[str, object]) -> None:
        return None

    def set_eviction_hints(self, reuse_of: Callable | None = None, retention: RetentionTable | None = None) -> None:
        return None

    def busy(self) -> bool:
        return False

    def stats(self) -> dict[str, object] | None:
        return None

    def shutdown(self) -> None:
        return None

    def close(self) -> None:
        return None


# name -> factory(store context) -> the tier, or None where the config leaves it off or it
# failed to open (the factory says why in the context's `tier_errors`).
Factory = Callable[[Any], "LowerTier | None"]
_REGISTRY: dict[str, Factory] = {}


def register_lower_tier(name: str, factory: Factory) -> None:
    """Make a tier buildable by name; registering a name again replaces its factory."""
    if not name or not name.isidentifier():
        raise ValueError(f"a lower tier's name must be an identifier, got {name!r}")
    _REGISTRY[name] = factory


def lower_tier_factory(name: str) -> Factory:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"no lower tier named {name!r} is registered (known: {', '.join(sorted(_REGISTRY))})") from None


def registered_lower_tiers() -> list[str]:
    return list(_REGISTRY)
