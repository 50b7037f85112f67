"""The CUDA copy executors on a real GPU: bytes, ordering against the compute stream,
and real cudaHostRegister. Skipped without CUDA (the CPU tests with a fake device are in
test_cuda_executors.py).

Descriptors are built straight from tensor data_ptrs: group g's page of block b sits at
gpu[g].data_ptr() + b * stride; its host copy at host + ((slot * groups) + g) * page.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.connector.copy.choice import make_cuda_executor
from kvstrata.connector.copy.descriptors import Descriptors

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

KIB = 1024
PAGE_SIZES = [8 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 2048 * KIB]


def _executors():
    from kvstrata.connector.copy.cuda_dma import CudaDmaExecutor
    from kvstrata.connector.copy.triton_copy import KernelExecutor

    return CudaDmaExecutor, KernelExecutor


@pytest.fixture
def pins():
    from kvstrata.connector.copy.pinning import Pinning

    pinning = Pinning()
    yield pinning
    torch.cuda.synchronize()
    pinning.close()


def layout(page: int, groups: int, seed: int = 0):
    """GPU KV tensors (random), a registered-later host arena (zeros), blocks and slots."""
    num_blocks = max(8, min(64, (64 << 20) // (page * groups)))
    g = torch.Generator().manual_seed(seed)
    gpu = [torch.randint(-128, 127, (num_blocks, page), dtype=torch.int8, generator=g).cuda() for _ in range(groups)]
    rng = np.random.default_rng(seed)
    count = num_blocks // 2
    blocks = np.sort(rng.choice(num_blocks, count, replace=False)).astype(np.int64)
    slots = rng.permutation(count).astype(np.int64)  # scattered, so rows do not merge
    host = torch.zeros(count * groups * page, dtype=torch.int8)
    return gpu, host, blocks, slots


def descriptors(gpu, host, blocks, slots, page, direction) -> Descriptors:
    groups = len(gpu)
    gpu_addr = np.concatenate([t.data_ptr() + blocks * t.stride(0) for t in gpu]).astype(np.int64)
    host_addr = np.concatenate([host.data_ptr() + (slots * groups + g) * page for g in range(groups)]).astype(np.int64)
    sizes = np.full(len(gpu_addr), page, dtype=np.int64)
    if direction == "store":
        return Descriptors(np.ascontiguousarray(host_addr), np.ascontiguousarray(gpu_addr), sizes)
    return Descriptors(np.ascontiguousarray(gpu_addr), np.ascontiguousarray(host_addr), sizes)


def expected_host(gpu, blocks, slots, page) -> torch.Tensor:
    groups = len(gpu)
    out = torch.zeros(len(slots) * groups * page, dtype=torch.int8)
    view = out.view(len(slots), groups, page)
    for g, t in enumerate(gpu):
        view[torch.from_numpy(slots), g] = t[torch.from_numpy(blocks)].cpu()
    return out


@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("page", PAGE_SIZES)
@pytest.mark.parametrize("loader", ["dma", "dma-rows", "kernel"])
def test_round_trip_is_bit_exact(pins, page, groups, loader):
    dma_cls, kernel_cls = _executors()
    gpu, host, blocks, slots = layout(page, groups)
    assert pins.register(host), "cudaHostRegister of a plain CPU tensor failed"
    original = [t.clone() for t in gpu]
    store = dma_cls(backend="rows" if loader == "dma-rows" else "auto")
    store.submit(1, "store", descriptors(gpu, host, blocks, slots, page, "store"))
    store.wait({1})
    (done,) = store.finished()
    assert done.success and done.num_bytes == len(blocks) * groups * page
    assert torch.equal(host, expected_host(original, blocks, slots, page))

    for t in gpu:
        t[torch.from_numpy(blocks).cuda()] = 0  # on the compute stream; the load waits for it
    load = kernel_cls(ledger=store.ledger) if loader == "kernel" else store
    load.submit(2, "load", descriptors(gpu, host, blocks, slots, page, "load"))
    load.wait({2})
    (done,) = load.finished()
    assert done.success
    for t, o in zip(gpu, original):
        assert torch.equal(t, o)
    store.close()


def test_store_right_after_a_kernel_that_writes_the_pages_sees_the_written_bytes(pins):
    dma_cls, _ = _executors()
    page = 16 * KIB
    gpu, host, blocks, slots = layout(page, 1)
    pins.register(host)
    ex = dma_cls()
    for attempt in range(5):
        torch.cuda._sleep(2_000_000)  # keep the compute stream busy so a racing store would win
        gpu[0][torch.from_numpy(blocks).cuda()] = attempt + 1
        ex.submit(attempt, "store", descriptors(gpu, host, blocks, slots, page, "store"))
        ex.wait({attempt})
        assert (host == attempt + 1).all(), f"attempt {attempt}: the store read pages before the write landed"
    ex.close()


@pytest.mark.parametrize("loader", ["dma", "kernel"])
def test_load_then_a_kernel_reading_the_pages_sees_the_loaded_bytes_after_wait(pins, loader):
    dma_cls, kernel_cls = _executors()
    page = 16 * KIB
    gpu, host, blocks, slots = layout(page, 2)
    pins.register(host)
    host.copy_(torch.randint(-128, 127, host.shape, dtype=torch.int8))
    dma = dma_cls()
    ex = kernel_cls(ledger=dma.ledger) if loader == "kernel" else dma
    index = torch.from_numpy(blocks).cuda()
    for attempt in range(3):
        torch.cuda._sleep(2_000_000)
        for t in gpu:
            t[index] = 0  # queued before the load: the load must land after it
        ex.submit(attempt, "load", descriptors(gpu, host, blocks, slots, page, "load"))
        ex.wait({attempt})
        expect = host.view(len(slots), 2, page)[torch.from_numpy(slots)]  # row i: block i's pages
        for g, t in enumerate(gpu):
            got = t[index].to(torch.int64).sum()  # a kernel on the compute stream reading the pages
            assert int(got) == int(expect[:, g].to(torch.int64).sum())
            assert torch.equal(t[index].cpu(), expect[:, g])
    dma.close()


def test_router_loads_by_kernel_and_dma_in_one_order(pins):
    page = 8 * KIB
    gpu, host, blocks, slots = layout(page, 1)
    pins.register(host)
    router = make_cuda_executor("auto", host_pinned=lambda: pins.failures == 0)
    router.submit(1, "store", descriptors(gpu, host, blocks, slots, page, "store"))
    router.wait({1})
    original = gpu[0].clone()
    gpu[0].zero_()
    router.submit(2, "load", descriptors(gpu, host, blocks, slots, page, "load"))
    router.wait({2})
    # 8 KiB rows, 16 or more of them: both the store and the load go by kernel under auto.
    assert router.counts["kernel"] == (2 if router.kernel is not None and len(blocks) >= 16 else 0)
    index = torch.from_numpy(blocks).cuda()
    assert torch.equal(gpu[0][index], original[index])
    assert [c.job_id for c in router.finished()] == [1, 2]
    router.close()


def test_a_refused_registration_does_not_poison_the_next_kernel_launch():
    from kvstrata.connector.copy import pinning

    host = torch.zeros(1 << 20, dtype=torch.int8)
    pins = pinning.Pinning()
    assert pins.register(host)
    try:
        with pytest.raises(pinning.HostRegisterError, match="AlreadyRegistered"):
            pinning.register_range(pins.cudart, host.data_ptr(), host.numel())
        x = torch.ones(1024, device="cuda")
        assert float((x * 2).sum()) == 2048.0  # torch checks cudaGetLastError after this launch
    finally:
        pins.close()


def test_kernel_load_of_rows_that_are_8_but_not_16_byte_multiples(pins):
    """The one-word kernel variant (ALIGN16 off): rows of page - 8 bytes, at +8 offsets."""
    _, kernel_cls = _executors()
    page = 8 * KIB
    gpu, host, blocks, slots = layout(page, 1)
    pins.register(host)
    host.copy_(torch.randint(-128, 127, host.shape, dtype=torch.int8))
    before = gpu[0].clone()
    full = descriptors(gpu, host, blocks, slots, page, "load")
    desc = Descriptors(full.dst + 8, full.src, full.sizes - 8)
    ex = kernel_cls()
    ex.submit(1, "load", desc)
    ex.wait({1})
    assert ex.finished()[0].success
    index = torch.from_numpy(blocks).cuda()
    got = gpu[0][index].cpu()
    want = host.view(len(slots), page)[torch.from_numpy(slots)]
    assert torch.equal(got[:, 8:], want[:, : page - 8])
    assert torch.equal(got[:, :8], before[index].cpu()[:, :8])  # the first word untouched
    ex.close()
