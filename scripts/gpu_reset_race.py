"""Issue #37, finding 5, on a GPU: what releasing a store's slots before vLLM flushed its
copy would do. Torch and kvstrata only (no vLLM, no Ray): the device machine can run it.

    python scripts/gpu_reset_race.py [OUT_DIR] [--device cuda|cpu] [--trials 20]

Each trial: the forward pass writes 8 chunks of KV (behind a busy compute stream, as in
an engine), the worker submits their store into 8 reserved arena slots (StrataWorker's
call), then the engine resets. In the order kvstrata used before the fix, the slots are
released at once and another engine takes them and writes its chunks (0xEE) before the
copy has landed; in the fixed order the slots go back only once the copy is flushed
(`wait`, what vLLM's flush does). Counted: trials in which the late store copy overwrote
the other engine's chunks. Prints one table; writes reset_race.json to OUT_DIR.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvstrata.connector.copy_engine import CopyEngine  # noqa: E402
from kvstrata._dev.gpucheck.layouts import Dims, build  # noqa: E402
from kvstrata.tiers.arena import Arena  # noqa: E402

CHUNKS = 8
SLEEP_CYCLES = 100_000_000  # ~50 ms of a busy compute stream ahead of the store's copy


def trial(engine: CopyEngine, layout, pool, job_id: int, release_before_flush: bool, cuda: bool) -> int:
    bpc = layout.dims.blocks_per_chunk
    slots = pool.reserve("engine", CHUNKS)
    blocks = np.arange(CHUNKS * bpc, dtype=np.int32)
    for entry in layout.canonical.tensors:  # the forward pass writes the chunks' KV
        entry.tensor[: CHUNKS * bpc].fill_(7)
    if cuda:
        torch.cuda._sleep(SLEEP_CYCLES)  # more of it on the compute stream: the copy waits behind
    engine.store(job_id, pool.geometry, blocks, [CHUNKS * bpc], [0], np.array(slots, dtype=np.int64))
    if not release_before_flush:
        engine.wait({job_id})  # vLLM's flush of the jobs in flight at the reset
    pool.release("engine", slots)  # the reset gives the slots back
    taken = pool.reserve("other", CHUNKS)  # another engine's stores (or a promotion) take them
    for slot in taken:
        pool.view(slot)[:] = 0xEE
    engine.wait({job_id})
    engine.finished()
    overwritten = sum(not bool((pool.view(slot) == 0xEE).all()) for slot in taken)
    pool.release("other", taken)
    return overwritten


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?", default=".")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    dims = Dims(num_blocks=CHUNKS * Dims().blocks_per_chunk + 8)
    layout = build("flash-attn/bf16", dims, args.device)
    folder = tempfile.mkdtemp(prefix="kvstrata-reset-race-", dir="/dev/shm")
    arena = Arena(folder, "race", 2 * CHUNKS * layout.rank_bytes, CHUNKS * layout.rank_bytes, lease_seconds=3600, prefault=True)
    pool = arena.pool("race", layout.rank_bytes)
    engine = CopyEngine.from_canonical(layout.canonical, dims.blocks_per_chunk, rank=0, rank_stride=layout.rank_bytes)
    results = {}
    try:
        job = 0
        for order in ("release before flush (before the fix)", "flush, then release (the fix)"):
            hits, started = 0, time.perf_counter()
            for _ in range(args.trials):
                job += 1
                hits += trial(engine, layout, pool, job, order.startswith("release"), cuda) > 0
            results[order] = {"trials": args.trials, "overwritten": hits, "seconds": round(time.perf_counter() - started, 2)}
    finally:
        engine.close()
        arena.close()
        shutil.rmtree(folder, ignore_errors=True)
    device = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"device: {device}; {CHUNKS} chunks of {layout.rank_bytes / 2**20:.1f} MiB per trial; copy engine: {engine.describe()}")
    for order, r in results.items():
        print(f"{order:40s} trials {r['trials']:3d}  the other engine's chunks overwritten in {r['overwritten']:3d}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "reset_race.json").write_text(json.dumps({"device": device, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
