"""One batched directory call: which holders have which of a prompt's chunks.

A prompt's keys are split by shard (`directory.shard_of`, the rule the stores publish
by); every shard that owns any of them gets one `coverage` call, all in flight at once;
the answers (one bitmask per holder, over that shard's share of the keys) are put back
in the prompt's key order. Several namespaces (nodes whose engines registered different
layouts of the model) go out in the same round.

Invariants: at most one call per shard and namespace per request; returns only when
every call answered, and raises `DirectoryUnavailable` when one fails or the deadline
passes (the caller routes without coverage); the answer's bit i means `keys[i]`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from kvstrata.actors.directory import shard_of


class DirectoryUnavailable(RuntimeError):
    """No directory, a shard that failed, or no answer before the deadline."""


def split_by_shard(keys: Sequence[bytes], shards: int) -> dict[int, list[int]]:
    """Shard -> positions (in `keys`) of the keys it owns."""
    positions: dict[int, list[int]] = {}
    for position, key in enumerate(keys):
        positions.setdefault(shard_of(key, shards), []).append(position)
    return positions


def merge_answers(positions: Mapping[int, list[int]], answers: Mapping[int, Mapping[str, int]]) -> dict[str, int]:
    """Per-shard masks (bit j: the shard's j-th key) -> masks over the whole prompt."""
    merged: dict[str, int] = {}
    for shard, masks in answers.items():
        where = positions[shard]
        for holder, mask in masks.items():
            out = merged.get(holder, 0)
            j = 0
            while mask:
                if mask & 1:
                    out |= 1 << where[j]
                mask >>= 1
                j += 1
            merged[holder] = out
    return merged


async def directory_coverage(
    shards: Sequence[Any], requests: Mapping[str, Sequence[bytes]], timeout_s: float
) -> dict[str, dict[str, int]]:
    """Namespace -> holder -> mask over that namespace's `keys`, from every shard concerned.

    `shards`: the shard actors' handles by shard number; `requests`: namespace -> keys.
    """
    if not shards:
        raise DirectoryUnavailable("no directory shards found")
    calls: list[tuple[str, int, Any]] = []
    positions: dict[str, dict[int, list[int]]] = {}
    for namespace, keys in requests.items():
        positions[namespace] = split_by_shard(keys, len(shards))
        for shard, where in positions[namespace].items():
            calls.append((namespace, shard, shards[shard].coverage.remote(namespace, [keys[p] for p in where])))
    try:
        replies = await asyncio.wait_for(asyncio.gather(*(ref for _, _, ref in calls)), timeout_s)
    except asyncio.TimeoutError:
        raise DirectoryUnavailable(f"no answer within {timeout_s * 1000:.0f} ms") from None
    except Exception as exc:  # noqa: BLE001 - a dead or restarting shard
        raise DirectoryUnavailable(f"{type(exc).__name__}: {exc}") from None
    answers: dict[str, dict[int, Mapping[str, int]]] = {namespace: {} for namespace in requests}
    for (namespace, shard, _), reply in zip(calls, replies):
        answers[namespace][shard] = reply
    return {namespace: merge_answers(positions[namespace], answers[namespace]) for namespace in requests}
