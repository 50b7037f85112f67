"""A transfer as three int64 arrays: destination address, source address, byte count.

Every executor (host row copy, CUDA DMA batch, Triton kernel) consumes this one form, so
the addresses that were bounds-checked are the addresses that move. `build_descriptors`
is the only place that turns a `CopyPlan` into addresses, for every device: it works
from integer bases and sizes alone (a CPU tensor's `data_ptr()`, a CUDA tensor's device
pointer, an arena segment's mapped address), so no executor trusts an address the
checks have not seen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

DIRECTIONS = ("store", "load")


# The Triton copy kernel moves int64 words: rows it copies are multiples of this, aligned to it.
WORD_BYTES = 8


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


class CopyPlan(NamedTuple):
    """One row per page copy: tensor, block, arena segment, byte offset in it, length.

    Built by `CopyEngine.plan` from a transfer and the slot layout; all columns are int64
    arrays of one length. Nothing here is checked yet: `build_descriptors` does that.
    """

    tensor_idx: np.ndarray
    block_id: np.ndarray
    segment: np.ndarray
    offset: np.ndarray
    num_bytes: np.ndarray


def _int64(values: Sequence[int] | np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64))


@dataclass(frozen=True)
class PageSpace:
    """The KV cache tensors as integers: page (block) t, b starts at `base[t] + b * row_stride[t]`.

    `row_bytes[t]` is the page size (no copy may be longer); `num_blocks[t]` bounds the
    block ids. All in bytes; the bases may be host or device addresses alike.
    """

    base: np.ndarray
    row_stride: np.ndarray
    row_bytes: np.ndarray
    num_blocks: np.ndarray

    @classmethod
    def of(
        cls,
        base: Sequence[int],
        row_stride: Sequence[int],
        row_bytes: Sequence[int],
        num_blocks: Sequence[int],
    ) -> PageSpace:
        columns = [_int64(c) for c in (base, row_stride, row_bytes, num_blocks)]
        if len({len(c) for c in columns}) != 1:
            raise ValueError(f"page space columns differ in length: {[len(c) for c in columns]}")
        return cls(*columns)


@dataclass(frozen=True)
class SlotSpace:
    """The mapped arena segments as integers, indexed by segment id.

    `base[s]`/`size[s]` are segment s's address and byte length where `mapped[s]`; a
    segment id past the arrays or not mapped is refused by the builder.
    """

    base: np.ndarray
    size: np.ndarray
    mapped: np.ndarray

    @classmethod
    def of(cls, segments: Mapping[int, tuple[int, int]]) -> SlotSpace:
        """`segments`: segment id -> (address, bytes)."""
        length = max((int(seg) + 1 for seg in segments), default=0)
        if any(int(seg) < 0 for seg in segments):
            raise ValueError(f"negative segment id in {sorted(segments)}")
        base = np.zeros(length, dtype=np.int64)
        size = np.zeros(length, dtype=np.int64)
        mapped = np.zeros(length, dtype=bool)
        for seg, (address, nbytes) in segments.items():
            base[seg], size[seg], mapped[seg] = address, nbytes, True
        return cls(base, size, mapped)


def _row(plan: CopyPlan, i: int) -> str:
    return (
        f"row {i}: tensor {int(plan.tensor_idx[i])}, block {int(plan.block_id[i])}, "
        f"segment {int(plan.segment[i])}, offset {int(plan.offset[i])}, {int(plan.num_bytes[i])} bytes"
    )


def _first(mask: np.ndarray) -> int | None:
    hits = np.flatnonzero(mask)
    return int(hits[0]) if hits.size else None


def check_plan(plan: CopyPlan, pages: PageSpace, slots: SlotSpace) -> None:
    """Raise ValueError naming the first row that reaches outside its page or its segment.

    Every row is checked before any address is handed out: executors trust their rows.
    """
    if len({len(column) for column in plan}) != 1:
        raise ValueError(f"copy plan columns differ in length: {[len(c) for c in plan]}")
    if not len(plan.num_bytes) or _all_inside(plan, pages, slots):
        return
    _raise_first_bad_row(plan, pages, slots)


def _all_inside(plan: CopyPlan, pages: PageSpace, slots: SlotSpace) -> bool:
    """One pass over the rows for the common case, where every row is fine."""
    tensor, segment = plan.tensor_idx, plan.segment
    if tensor.min() < 0 or tensor.max() >= len(pages.base) or segment.min() < 0 or segment.max() >= len(slots.mapped):
        return False
    block, offset, nbytes = plan.block_id, plan.offset, plan.num_bytes
    bad = (block < 0) | (block >= pages.num_blocks[tensor]) | (nbytes < 0) | (nbytes > pages.row_bytes[tensor])
    bad |= ~slots.mapped[segment] | (offset < 0) | (offset + nbytes > slots.size[segment])
    return not bad.any()


def _raise_first_bad_row(plan: CopyPlan, pages: PageSpace, slots: SlotSpace) -> None:
    """The error for the first row of the first kind of fault, in a fixed order of kinds."""
    tensor, block, segment = plan.tensor_idx, plan.block_id, plan.segment
    offset, nbytes = plan.offset, plan.num_bytes
    i = _first((tensor < 0) | (tensor >= len(pages.base)))
    if i is not None:
        raise ValueError(f"tensor {int(tensor[i])} does not exist; there are {len(pages.base)} ({_row(plan, i)})")
    i = _first(nbytes < 0)
    if i is not None:
        raise ValueError(f"a copy of a negative byte count ({_row(plan, i)})")
    i = _first((block < 0) | (block >= pages.num_blocks[tensor]))
    if i is not None:
        raise ValueError(
            f"block {int(block[i])} of tensor {int(tensor[i])} is outside its "
            f"{int(pages.num_blocks[tensor[i]])} blocks ({_row(plan, i)})"
        )
    i = _first(nbytes > pages.row_bytes[tensor])
    if i is not None:
        raise ValueError(
            f"a copy of {int(nbytes[i])} bytes from block {int(block[i])} of tensor {int(tensor[i])} "
            f"is longer than its {int(pages.row_bytes[tensor[i]])}-byte page ({_row(plan, i)})"
        )
    known = (segment >= 0) & (segment < len(slots.mapped))
    i = _first(~known)
    if i is None:
        i = _first(~slots.mapped[segment])
    if i is not None:
        raise ValueError(f"arena segment {int(segment[i])} is not mapped ({_row(plan, i)})")
    i = _first((offset < 0) | (offset + nbytes > slots.size[segment]))
    if i is not None:
        raise ValueError(
            f"a copy of {int(nbytes[i])} bytes at offset {int(offset[i])} lies outside arena segment "
            f"{int(segment[i])} ({int(slots.size[segment[i]])} bytes) ({_row(plan, i)})"
        )
    raise AssertionError(f"a copy plan failed the bounds check but no row is at fault: {plan}")


def merge_runs(desc: Descriptors, buffer_key: np.ndarray | None = None) -> Descriptors:
    """Join each row to the one before it where both its source and its destination
    continue that row's: consecutive GPU blocks of one tensor, copied whole, landing on
    consecutive pages of a slot become one copy.

    Rows keep their order; the bytes moved are exactly the same. With `buffer_key` (one
    integer per row), rows merge only within one key, so a merged row never spans two
    buffers that merely happen to sit next to each other in memory (two CUDA allocations,
    two separately registered host segments).
    """
    dst, src, sizes = desc
    if len(sizes) < 2:
        return desc
    ends_dst = dst[:-1] + sizes[:-1]
    ends_src = src[:-1] + sizes[:-1]
    joins = (ends_dst == dst[1:]) & (ends_src == src[1:])
    if buffer_key is not None:
        joins &= buffer_key[:-1] == buffer_key[1:]
    if not joins.any():
        return desc
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    merged = np.add.reduceat(sizes, starts)
    return Descriptors(
        np.ascontiguousarray(dst[starts]), np.ascontiguousarray(src[starts]), np.ascontiguousarray(merged, dtype=np.int64)
    )


def build_descriptors(
    direction: str, plan: CopyPlan, pages: PageSpace, slots: SlotSpace, merge: bool = True
) -> Descriptors:
    """The transfer's (dst, src, sizes): page address = tensor base + block * row stride,
    slot address = segment base + offset; "store" copies pages to slots, "load" back.

    Every row is bounds-checked first (`check_plan`), so a bad row raises before any
    executor sees an address. With `merge`, contiguous rows of one tensor and one
    segment are joined (`merge_runs`).
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    plan = CopyPlan(*(_int64(column) for column in plan))
    check_plan(plan, pages, slots)
    tensor = plan.tensor_idx
    page_addr = pages.base[tensor] + plan.block_id * pages.row_stride[tensor]
    slot_addr = slots.base[plan.segment] + plan.offset
    if direction == "store":
        desc = Descriptors(slot_addr, page_addr, plan.num_bytes)
    else:
        desc = Descriptors(page_addr, slot_addr, plan.num_bytes)
    if merge:
        desc = merge_runs(desc, plan.segment * len(pages.base) + tensor)
    return desc
