"""Prefix-chain admission: which chunks are worth a write to a lower tier.

Why: a chunk is only ever read back as part of a prefix. An engine looks a request's
chunks up in order and stops at the first miss, so a chunk whose predecessors are gone
from every tier is dead weight, however likely its own reuse. On real chat traffic
(Mooncake's conversation trace, docs/real-traffic.md) reuse is all-or-nothing per
conversation turn and a store sees almost nothing that tells the turns apart at write
time; what it does see is where a chunk sits in its prefix chain. Writing the head of
every chain, and whatever was used again, keeps the chains that are read later whole
from their first chunk: the same number of writes spent at random (or on the tails)
buys a third of the hits, because a tail without its head is never reached.

The rule: a chunk is admitted when it was used `min_uses` times (the reuse sketch the
store already keeps, frequency.py), or when its prefix ends at most `head_tokens`
tokens into its request. Positions come from the engine (vLLM's scheduler records each
chunk's end token, `ReqContext.get_offload_key_position`; the manager sends them with
its commits). A chunk whose position the store never heard (an older vLLM, a tool that
commits without one) is admitted: the policy only ever skips what it knows is a tail.

Owns: the positions of chunks committed lately, at most `remembered` of them (the oldest
are forgotten first: a chunk is decided at its eviction from the arena, well within
that many commits). Plain Python, no locks (the node store calls it under its lock);
must not import Ray or vLLM.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class ChainAdmission:
    def __init__(self, head_tokens: int, remembered: int = 1 << 20):
        if head_tokens < 0:
            raise ValueError(f"head_tokens must be >= 0, not {head_tokens}")
        if remembered < 1:
            raise ValueError(f"remembered must be >= 1, not {remembered}")
        self.head_tokens = head_tokens
        self.remembered = remembered
        self._positions: OrderedDict[bytes, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._positions)

    def note_positions(self, positions: Iterable[tuple[bytes, int]]) -> None:
        """Remember where committed chunks end (token positions within their requests)."""
        known = self._positions
        for key, position in positions:
            if key in known:
                known.move_to_end(key)
                # A chunk shared by two requests ends at the same token in both (its
                # prefix is the same): keep the smaller if an engine ever says otherwise.
                position = min(position, known[key])
            known[key] = int(position)
        while len(known) > self.remembered:
            known.popitem(last=False)

    def position(self, key: bytes) -> int | None:
        return self._positions.get(key)

    def in_head(self, key: bytes) -> bool:
        """Whether the chunk sits in the head of its chain (or its position is unknown)."""
        position = self._positions.get(key)
        return position is None or position <= self.head_tokens

    def admit(self, keys: Sequence[bytes], reused: Sequence[bool]) -> list[bool]:
        """Per key: written down if used often enough (`reused`, from the reuse sketch) or in the head."""
        return [was_reused or self.in_head(key) for key, was_reused in zip(keys, reused)]
