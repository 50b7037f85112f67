"""What computing a model's identity costs at engine start, beside the engine's own model load.

Builds a random-weight Llama checkpoint of `--gib` GiB (bfloat16 safetensors), then in
one run:
- the time vLLM (CPU build) takes to start an engine on it without kvstrata, with the
  checkpoint evicted from the page cache first (what a fresh node pays), and the
  weight-loading part vLLM logs;
- kvstrata's `sampled` and `full` fingerprints of the same checkpoint, each cold
  (evicted from the page cache with posix_fadvise) and warm (just read).

The goal (issue #30): the default (`sampled`) costs < 5 % of the model's load time.

    python benchmarks/model_identity.py --gib 2 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from kvstrata.identity import FULL, SAMPLED, checkpoint_files, fingerprint_checkpoint  # noqa: E402


def build_checkpoint(directory: Path, gib: float) -> Path:
    """A Llama of about `gib` GiB in bfloat16: 2048 wide, as many layers as fit."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvstrata.testing import build_tiny_llama

    if (directory / "config.json").exists():
        return directory
    source = build_tiny_llama(directory.parent / f"{directory.name}-tokenizer")  # a tokenizer vLLM can load
    directory.mkdir(parents=True)
    for name in os.listdir(source):
        if name.startswith(("tokenizer", "special_tokens")):
            os.replace(source / name, directory / name)
    hidden, intermediate = 2048, 5632
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)  # bytes in bf16
    layers = max(1, round(gib * (1 << 30) / per_layer))
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def evict(directory: Path) -> None:
    """Drop the checkpoint's pages from the page cache, as on a node that has not read it yet."""
    for path in checkpoint_files(directory):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def time_fingerprint(directory: Path, mode: str, cold: bool) -> float:
    if cold:
        evict(directory)
    start = time.perf_counter()
    fingerprint_checkpoint(directory, mode)
    return time.perf_counter() - start


def time_engine_start(directory: Path) -> tuple[float, float]:
    """Seconds to start an engine on the cold checkpoint, and the part spent in vLLM's
    weight loader (timed around `DefaultModelLoader.load_weights`, engine core in-process)."""
    from vllm import LLM
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loading = DefaultModelLoader.load_weights
    spent: list[float] = []

    def timed(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return loading(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - began)

    evict(directory)
    DefaultModelLoader.load_weights = timed
    try:
        start = time.perf_counter()
        llm = LLM(model=str(directory), dtype="bfloat16", block_size=32, max_model_len=512, enforce_eager=True)
        elapsed = time.perf_counter() - start
    finally:
        DefaultModelLoader.load_weights = loading
    llm.llm_engine.engine_core.shutdown()
    del llm
    return elapsed, sum(spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="checkpoint size (default 2 GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="fingerprint rounds per mode (medians reported)")
    parser.add_argument("--dir", type=Path, default=None, help="keep the checkpoint here (default: a temp dir, removed)")
    args = parser.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the load log line reaches this process

    with tempfile.TemporaryDirectory(prefix="kvstrata-identity-bench-") as scratch:
        directory = build_checkpoint(args.dir or Path(scratch) / "model", args.gib)
        size = sum(path.stat().st_size for path in checkpoint_files(directory))
        engine_s, weights_s = time_engine_start(directory)
        figures = {
            (mode, cold): statistics.median(time_fingerprint(directory, mode, cold) for _ in range(args.rounds))
            for mode in (SAMPLED, FULL)
            for cold in (True, False)
        }
        print(f"checkpoint: {size / (1 << 30):.2f} GiB in {len(checkpoint_files(directory))} files at {directory}")
        print(f"engine start (cold page cache, no kvstrata): {engine_s:.1f} s, of which vLLM's weight loader {weights_s:.1f} s")
        reference = weights_s
        print(f"{'mode':8} {'cache':6} {'seconds':>9} {'÷ weights load':>15} {'÷ engine start':>15}")
        for (mode, cold), seconds in figures.items():
            print(f"{mode:8} {'cold' if cold else 'warm':6} {seconds:9.4f} {seconds / reference:15.2%} {seconds / engine_s:15.2%}")


if __name__ == "__main__":
    main()
