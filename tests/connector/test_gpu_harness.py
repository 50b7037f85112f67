"""The GPU check's worker harness (kvstrata._dev.gpucheck): on CPU here, on CUDA under -m gpu.

The harness is only worth running on a rare GPU if it can fail: a copy engine that drops
or misplaces a row must be reported, and every layout's canonical view must cover exactly
what its backend's kernels write.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.connector.copy_engine import CopyEngine
from kvstrata._dev.gpucheck.harness import WorkerHarness, default_shm_root, main
from kvstrata._dev.gpucheck.layouts import CPU_DIMS, GPU_DIMS, LAYOUTS, build


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layout_round_trips_exactly_through_a_real_arena_on_cpu(layout):
    report = WorkerHarness(layout, CPU_DIMS, "cpu", "auto", seed=3, shm_root=default_shm_root()).run(rounds=12)
    assert report.ok, report.failures
    assert report.stores > 0 and report.loads > 0 and report.chunks_checked > report.stores
    assert report.resets == 1 and report.restarts == 1


def test_a_copy_engine_that_drops_a_row_is_reported(monkeypatch):
    real = CopyEngine.descriptors

    def lossy(self, direction, plan, segments):
        desc = real(self, direction, plan, segments)
        return type(desc)(*(np.ascontiguousarray(a[:-1]) for a in desc)) if desc.rows > 1 else desc

    monkeypatch.setattr(CopyEngine, "descriptors", lossy)
    report = WorkerHarness("flashinfer/bf16", CPU_DIMS, "cpu", "auto", seed=1, shm_root=default_shm_root()).run(rounds=8)
    assert not report.ok
    assert any("differ" in f or "bytes, expected" in f or "byte" in f for f in report.failures), report.failures


def test_a_copy_engine_that_swaps_two_rows_destinations_is_reported(monkeypatch):
    real = CopyEngine.descriptors

    def swapped(self, direction, plan, segments):
        desc = real(self, direction, plan, segments)
        if desc.rows > 1 and desc.sizes[0] == desc.sizes[1]:
            desc.dst[[0, 1]] = desc.dst[[1, 0]]
        return desc

    monkeypatch.setattr(CopyEngine, "descriptors", swapped)
    report = WorkerHarness("flash-attn-split/fp8", CPU_DIMS, "cpu", "auto", seed=2, shm_root=default_shm_root()).run(rounds=8)
    assert not report.ok


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_canonical_view_covers_exactly_what_the_backend_writes(layout):
    """A kernel writing one block through every view of a group changes that block's
    canonical pages only inside the group's refs, and nothing of any other block."""
    kv = build(layout, CPU_DIMS, "cpu")
    gen = torch.Generator().manual_seed(0)
    for group, views in enumerate(kv.views):
        before = [t.tensor.clone() for t in kv.canonical.tensors]
        block = torch.tensor([5])
        for view in views:
            view.write(block, gen)
        covered = {ref.tensor_idx: ref.page_size_bytes for ref in kv.canonical.group_data_refs[group]}
        for t, (entry, old) in enumerate(zip(kv.canonical.tensors, before)):
            new = entry.tensor
            assert torch.equal(new[:5], old[:5]) and torch.equal(new[6:], old[6:]), f"{layout}: tensor {t} other blocks"
            changed = (new[5] != old[5]).nonzero()
            if t not in covered:
                assert changed.numel() == 0, f"{layout}: group {group} wrote tensor {t} outside its refs"
            elif changed.numel():
                assert int(changed.max()) < covered[t], f"{layout}: group {group} wrote past its {covered[t]}-byte ref"
        written = sum(int((e.tensor[5] != o[5]).sum()) for e, o in zip(kv.canonical.tensors, before))
        assert written > 0.9 * sum(covered.values()), f"{layout}: group {group}'s views leave its refs mostly unwritten"


def test_the_command_writes_its_report_and_exits_zero(tmp_path, capsys):
    out = tmp_path / "harness.json"
    assert main(["--device", "cpu", "--layouts", "hybrid/bf16,cross-layer/bf16", "--rounds", "6", "--out", str(out)]) == 0
    assert "every byte exact" in capsys.readouterr().out
    assert out.read_text().count('"layout"') == 2


def test_bad_layout_names_are_refused_by_name():
    with pytest.raises(ValueError, match="unknown KV layout 'paged'"):
        build("paged/bf16", CPU_DIMS, "cpu")
    with pytest.raises(ValueError, match="unknown KV cache dtype 'fp4'"):
        build("flashinfer/fp4", CPU_DIMS, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["auto", "kernel"])
@pytest.mark.parametrize("layout", ["flash-attn-split/fp8", "hybrid/bf16"])
def test_the_worker_path_is_exact_on_cuda(layout, mode):
    """The CUDA executors, the arena's registration and the compute-stream ordering,
    under the harness's interleavings (the full matrix runs in scripts/gpu_check.py)."""
    report = WorkerHarness(layout, GPU_DIMS, "cuda", mode, seed=5, shm_root=default_shm_root()).run(rounds=10)
    assert report.ok, report.failures
    assert report.registered_mib > 0 and report.pin_failures == 0
    if mode == "kernel":
        assert report.kernel_jobs > 0
