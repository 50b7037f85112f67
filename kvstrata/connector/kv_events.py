"""What kvstrata's KV events say about each tier: the one mapping from a kvstrata tier to
the medium, locality and ownership of a vLLM `OffloadingEvent`.

Why: routers credit a replica for the chunks its engine announces, by medium. Ray's
`KVAwareRouter` (through Dynamo's indexer) credits `CPU` as host memory of that worker
(0.75 of a GPU block), Dynamo `STORAGE` as disk (0.25); llm-d scores each medium by a
table (CPU 0.8, shared storage 0.4, object store 0.2, unknown 0). A chunk in *another*
node's arena is not host memory of this node: loading it is a network fetch. Announced
as `CPU` (what kvstrata did before), every engine of the cluster would be credited with
every chunk any node holds, as if it were in its own RAM, and the router would learn
nothing. So:

| kvstrata tier | medium | locality | ownership | what it is for the announcing engine |
|---|---|---|---|---|
| `CPU` (node arena) | `CPU` | `LOCAL` | none (vLLM's primary tier) | host RAM of its node, shared by every engine there |
| `STORAGE` (node disk) | `STORAGE` | `LOCAL` | `kvstrata-disk` | local disk of its node, shared by every engine there |
| `OBJECT` (bucket) | `STORAGE` | `REMOTE` | `kvstrata-object` | remote storage every node reads |
| `PEER` (another node) | `STORAGE` | `REMOTE` | `kvstrata-peer` | a fetch from another node's store |

vLLM has two media (`CPU`, `STORAGE`); locality and ownership carry the rest for
consumers that read them (vLLM 0.32+ has `locality`). docs/routing.md gives the weights
to configure in Ray's, Dynamo's and llm-d's routers.

Invariants: pure data and a pure function; the arena's ownership stays None, which is
what vLLM's self-describing event tracker calls its primary tier (a store and its
removal must carry the same (medium, ownership) pair, or the tracker keeps the chunk's
payload forever). Imports nothing of vLLM (compat builds the event from these fields).
"""

from __future__ import annotations

from typing import NamedTuple


class EventFields(NamedTuple):
    medium: str  # vLLM's Medium value: CPU or STORAGE
    locality: str  # vLLM's Locality value: LOCAL or REMOTE
    ownership: str | None  # vLLM's secondary-tier name; None: the primary tier (the arena)


TIER_EVENTS: dict[str, EventFields] = {
    "CPU": EventFields("CPU", "LOCAL", None),
    "STORAGE": EventFields("STORAGE", "LOCAL", "kvstrata-disk"),
    "OBJECT": EventFields("STORAGE", "REMOTE", "kvstrata-object"),
    "PEER": EventFields("STORAGE", "REMOTE", "kvstrata-peer"),
}


def event_fields(tier: str) -> EventFields:
    """The medium, locality and ownership of a kvstrata tier's events."""
    try:
        return TIER_EVENTS[tier]
    except KeyError:
        raise ValueError(f"kvstrata: no KV-event mapping for tier {tier!r} (known: {', '.join(TIER_EVENTS)})") from None
