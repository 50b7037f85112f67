"""A transfer as three int64 arrays: destination address, source address, byte count.

Every executor (host row copy, CUDA DMA batch, Triton kernel) consumes this one form, so
the addresses that were bounds-checked are the addresses that move.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Descriptors(NamedTuple):
    """Row i copies `sizes[i]` bytes from address `src[i]` to address `dst[i]`.

    Invariants: the three arrays are C-contiguous int64 of one length; every row lies
    inside the buffers it names (checked when built); rows never overlap each other's
    destinations within one transfer.
    """

    dst: np.ndarray
    src: np.ndarray
    sizes: np.ndarray

    @property
    def num_bytes(self) -> int:
        return int(self.sizes.sum())

    @property
    def rows(self) -> int:
        return len(self.sizes)
