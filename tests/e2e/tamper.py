"""Overwriting chunks in a running node store's arena: the control that proves outputs
came from the bytes kvstrata stored (corrupt them, and the output changes)."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import ray

from kvstrata.actors.client import get_node_store
from kvstrata.keys import key_group
from kvstrata.tiers.shm import SharedMemoryFile


def corrupt_chunks(namespace: str, groups: Collection[int] | None = None) -> int:
    """Overwrite the resident chunks of a namespace (of `groups` only, if given) with noise."""
    store = get_node_store()
    rng = np.random.default_rng(0)
    count = 0
    for key in ray.get(store.keys.remote(namespace)):
        if groups is not None and key_group(key) not in groups:
            continue
        path, offset, length = ray.get(store.locate.remote(namespace, key))
        segment = SharedMemoryFile.attach(path)
        segment.array[offset : offset + length] = rng.integers(0, 256, length, dtype=np.uint8)
        segment.close()
        count += 1
    return count
