"""Eviction order that weighs estimated reuse: of the oldest few candidates, the least reused go first.

Why (issue #28, cost-based admission): evictions in the lower tiers should spare chunks
that will likely be read again. Pure age order lets a burst of one-off prompts push out
a prefix that every request shares, just because the prefix was written earlier. With
a reuse estimate (the node store's count-min sketch, `kvstrata.tiers.frequency`), the
oldest few candidates are weighed against each other and the one-offs among them go
first. Only a few: the sketch forgets (it halves its counts), so a chunk counted as
reused long ago must not outlive everything written since. Age still rules between
windows. Shared by the disk tier's index and the object tier's capacity sweep, so both
evict alike.

Invariants:
- With `reuse_of` None, `least_reused_first` yields the candidates exactly as given.
- With it set, the candidates are cut, in the order given, into windows of `window`;
  each window comes out least reused first, ties in the order given (oldest first). No
  candidate comes out before every candidate of an earlier window has.
- Candidates are read lazily, one window at a time, and `reuse_of` is called once per
  namespace of a window, only when that window's first candidate is asked for: a caller
  that stops early asks nothing more, and may change what the candidates still to be
  read are (the disk drops an anchor's dependents) between two of them.
- Counts of different namespaces are compared as they are (each namespace has its own
  sketch, counting uses among that namespace's recent uses).

No Ray and no vLLM in here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import TypeVar

# (namespace, keys) -> each key's estimated recent uses (`ReuseCounter.estimate`).
ReuseOf = Callable[[str, list[bytes]], Sequence[int]]

# Oldest candidates weighed against each other by reuse: wide enough that a one-off
# among them goes first, narrow enough that age still rules.
REUSE_EVICTION_WINDOW = 8

T = TypeVar("T")


def least_reused_first(
    candidates: Iterable[T],
    name_of: Callable[[T], tuple[str, bytes]],
    reuse_of: ReuseOf | None,
    window: int = REUSE_EVICTION_WINDOW,
) -> Iterator[T]:
    """`candidates` (oldest first) in eviction order: as given when `reuse_of` is None,
    else each window of `window` least reused first, ties oldest first.

    `name_of` gives a candidate's (namespace, key), what `reuse_of` is asked about.
    """
    if window < 1:
        raise ValueError("window must be at least 1")
    if reuse_of is None:
        yield from candidates
        return
    remaining = iter(candidates)
    while batch := list(islice(remaining, window)):
        names = [name_of(candidate) for candidate in batch]
        by_namespace: dict[str, list[int]] = {}
        for position, (namespace, _) in enumerate(names):
            by_namespace.setdefault(namespace, []).append(position)
        uses = [0] * len(batch)
        for namespace, positions in by_namespace.items():
            counts = reuse_of(namespace, [names[position][1] for position in positions])
            for position, count in zip(positions, counts, strict=True):
                uses[position] = int(count)
        for position in sorted(range(len(batch)), key=lambda position: (uses[position], position)):
            yield batch[position]
        if len(batch) < window:
            return
