"""What the model fingerprint costs at an engine's first start and at a restart, beside
vLLM's own loading of the same checkpoint, measured in the same run.

For each `--gib` size, writes a random-weight Llama checkpoint (bfloat16 safetensors
shards, finite values, written tensor by tensor so a 16 GiB one needs no 16 GiB of
RAM), plus a Hugging Face cache layout of the same files (hard links in `blobs/`
named by their sha256, a snapshot of relative links), then measures:
- vLLM's reading of the checkpoint: `safetensors_weights_iterator` (what vLLM's default
  loader iterates) over every tensor, page cache cold and warm; and, for checkpoints up
  to `--engine-max-gib`, a whole vLLM engine start (CPU build, engine core in-process)
  with the part spent in its weight loader, cold;
- kvstrata's fingerprint, cold and warm: `exact` at a first start (nothing remembered)
  and at a restart (digests remembered), `exact` on the hub snapshot (first start: every
  name verified against its blob's bytes; restart: remembered), `full`, `sampled`.
Cold means: every file of the checkpoint evicted from the page cache
(`posix_fadvise(DONTNEED)` after `fsync`), checked with `mincore` (the resident share
is printed). Goals (issue #38): restart <= 10 ms; first start <= 25 % of vLLM's load
of the same checkpoint; a hub snapshot at a restart <= 10 ms whatever its size. Issue
#50: a first start costs <= 10 ms of the engine's start path ("engine's start path": the
fingerprint asked within the connector's start-up read limit, refused, and started on a
thread, as `StrataSpec.get_manager` does; the thread's own time is printed below it).

    python benchmarks/model_identity.py --gib 2 16 --rounds 3

The checkpoints are written under `--dir` (default: the system temp folder) and
removed at the end; the free disk space is checked first.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import mmap
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the weight loader runs in this process

from kvstrata.identity import (  # noqa: E402
    EXACT,
    FULL,
    SAMPLED,
    DigestCache,
    LongRead,
    checkpoint_files,
    fingerprint,
    sampled_ranges,
)

SHARD_BYTES = 4 << 30
WRITE_BYTES = 64 << 20


def llama_config(gib: float) -> dict:
    """A Llama of at least `gib` GiB in bfloat16: 4096 wide (8B-like layers), as many layers as that takes."""
    hidden, intermediate, vocab = 4096, 14336, 32000
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * intermediate)  # q, k, v, o (MHA) and the MLP
    layers = max(1, math.ceil((gib * (1 << 30) - 2 * 2 * vocab * hidden) / per_layer))  # at least `gib`
    return dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab, hidden_size=hidden,
        intermediate_size=intermediate, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=32,
        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
        tie_word_embeddings=False,
    )  # fmt: skip


def parameter_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    return [(name, tuple(tensor.shape)) for name, tensor in model.state_dict().items()]


def shard_tensors(config: dict, shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The parameters in the order `save_pretrained` writes them, cut into shards of at most `shard_bytes`."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in parameter_shapes(config):
        nbytes = 2 * int(np.prod(shape))
        if size and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def random_bf16(count: int, rng: np.random.Generator) -> bytes:
    """`count` finite bfloat16 values, |x| in [2^-7, 2^-6): random sign and mantissa, fixed exponent."""
    bits = rng.integers(0, 1 << 16, count, dtype=np.uint16)
    return ((bits & np.uint16(0x807F)) | np.uint16(0x3C00)).astype("<u2").tobytes()


def write_checkpoint(directory: Path, gib: float) -> dict[str, str]:
    """Shards of at most SHARD_BYTES, their index, config and tokenizer; returns each shard's sha256."""
    from kvstrata._dev.testing import build_tiny_llama

    directory.mkdir(parents=True)
    tokenizer = build_tiny_llama(directory.parent / "tokenizer-source")
    for name in os.listdir(tokenizer):
        if name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(tokenizer / name, directory / name)
    shutil.rmtree(tokenizer)
    config = llama_config(gib)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    shards = shard_tensors(config, SHARD_BYTES)
    rng, weight_map, sha256 = np.random.default_rng(0), {}, {}
    for index, tensors in enumerate(shards):
        file_name = f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for name, shape in tensors:
            nbytes = 2 * int(np.prod(shape))
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
            weight_map[name] = file_name
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        digest = hashlib.sha256()
        with open(directory / file_name, "wb") as handle:
            for piece in (len(encoded).to_bytes(8, "little"), encoded):
                handle.write(piece)
                digest.update(piece)
            for _ in range(0, offset, WRITE_BYTES):
                piece = random_bf16(min(WRITE_BYTES, offset - handle.tell() + 8 + len(encoded)) // 2, rng)
                handle.write(piece)
                digest.update(piece)
        sha256[file_name] = digest.hexdigest()
    index_file = {"metadata": {"total_size": sum(2 * int(np.prod(s)) for t in shards for _, s in t)}}
    (directory / "model.safetensors.index.json").write_text(json.dumps({**index_file, "weight_map": weight_map}))
    return sha256


def hub_layout(checkpoint: Path, cache: Path, sha256: dict[str, str]) -> Path:
    """The checkpoint as a Hugging Face cache holds it: blobs named by content, a snapshot of links."""
    repo = cache / "models--bench--random-llama"
    snapshot = repo / "snapshots" / ("0123456789abcdef" * 2 + "01234567")
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for path in checkpoint_files(checkpoint):
        name = sha256.get(path.name)
        if name is None:  # a small file: its git blob id
            content = path.read_bytes()
            name = hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()
        os.link(path, repo / "blobs" / name)
        (snapshot / path.name).symlink_to(f"../../blobs/{name}")
    return snapshot


def evict(files: list[Path]) -> None:
    """Drop the files' pages from the page cache, as on a node that has not read them yet."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_share(files: list[Path]) -> float:
    """The share of the files' pages in the page cache (mincore(2) on a private mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    resident = total = 0
    for path in files:
        size = path.stat().st_size
        if not size:
            continue
        pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vector = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
            anchor = ctypes.c_char.from_buffer(mapped)
            try:
                if libc.mincore(ctypes.addressof(anchor), size, vector) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed")
            finally:
                del anchor
        resident += sum(byte & 1 for byte in vector)
        total += pages
    return resident / total if total else 0.0


def timed(action: Callable[[], object], files: list[Path], cold: bool) -> tuple[float, float]:
    """Seconds `action` takes, after evicting `files` when `cold`; and the share of their
    pages that was in the page cache when it started."""
    if cold:
        evict(files)
    resident = resident_share(files)
    began = time.perf_counter()
    action()
    return time.perf_counter() - began, resident


def vllm_read(files: list[Path]) -> None:
    """vLLM's default loader's reading, tensor by tensor, each copied once as its
    `weight_loader` copies it into the model (here into one reused buffer: a lower bound
    of vLLM's load, which also first-touches every parameter's memory)."""
    import torch
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    buffer = torch.empty(0, dtype=torch.bfloat16)
    for _, tensor in safetensors_weights_iterator([str(f) for f in files if f.suffix == ".safetensors"], False):
        flat = tensor.reshape(-1)
        if buffer.numel() < flat.numel():
            buffer = torch.empty(flat.numel(), dtype=flat.dtype)
        buffer[: flat.numel()].copy_(flat)


def vllm_engine_start(directory: Path) -> tuple[float, float]:
    """Seconds to start an engine on the cold checkpoint, and the part in vLLM's weight loader."""
    from vllm import LLM
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loading, spent = DefaultModelLoader.load_weights, []

    def timed_loading(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return loading(self, *args, **kwargs)
        finally:
            spent.append(time.perf_counter() - began)

    evict(checkpoint_files(directory))
    DefaultModelLoader.load_weights = timed_loading
    try:
        began = time.perf_counter()
        llm = LLM(model=str(directory), dtype="bfloat16", block_size=32, max_model_len=512, enforce_eager=True)
        elapsed = time.perf_counter() - began
    finally:
        DefaultModelLoader.load_weights = loading
    llm.llm_engine.engine_core.shutdown()
    del llm
    return elapsed, sum(spent)


def measure(gib: float, scratch: Path, rounds: int, engine_max_gib: float) -> None:
    need = int(gib * (1 << 30) * 1.1) + (1 << 30)
    free = shutil.disk_usage(scratch).free
    if free < need:
        raise SystemExit(f"--gib {gib}: {need / (1 << 30):.1f} GiB of free disk needed in {scratch}, {free / (1 << 30):.1f} free")
    root = scratch / f"bench-{gib:g}gib"
    try:
        began = time.perf_counter()
        sha256 = write_checkpoint(root / "model", gib)
        files = checkpoint_files(root / "model")
        snapshot = hub_layout(root / "model", root / "hub", sha256)
        size = sum(path.stat().st_size for path in files)
        print(f"\n== {size / (1 << 30):.2f} GiB in {len(files)} files ({time.perf_counter() - began:.0f} s to write)")
        reference: dict[str, float] = {}
        vllm_read(files[:1])  # imports vLLM outside the timing
        reference["vLLM weights iterator + copy, cold"], cold = timed(lambda: vllm_read(files), files, True)
        reference["vLLM weights iterator + copy, warm"], warm = timed(lambda: vllm_read(files), files, False)
        if gib <= engine_max_gib:
            engine_s, loader_s = vllm_engine_start(root / "model")
            reference["vLLM engine start, cold"] = engine_s
            reference["vLLM weight loader in that start"] = loader_s
        for name, seconds in reference.items():
            print(f"{name:48} {seconds:9.3f} s")
        load = reference.get("vLLM weight loader in that start", reference["vLLM weights iterator + copy, cold"])
        print(f"(page cache: {cold:.1%} of the checkpoint resident when cold, {warm:.1%} when warm)")

        def first_start(path: Path) -> Callable[[], object]:
            def run():
                with tempfile.TemporaryDirectory(dir=root) as fresh:
                    fingerprint(path, EXACT, DigestCache(Path(fresh)))

            return run

        background: list[float] = []

        def start_path(path: Path) -> Callable[[], object]:
            """A first start as the engine makes it (connector/spec.py): the fingerprint within
            the start-up read limit, and past it a deferred start; only that is on the clock."""
            from kvstrata.connector.deferred_start import DeferredStart
            from kvstrata.connector.spec import READ_AT_START_BYTES

            def run():
                fresh = Path(tempfile.mkdtemp(dir=root))
                cache = DigestCache(fresh)
                try:
                    fingerprint(path, EXACT, cache, read_limit=READ_AT_START_BYTES)
                    return
                except LongRead:
                    pending = DeferredStart(lambda: fingerprint(path, EXACT, cache))
                settled.append((pending, fresh))

            return run

        settled: list = []

        def settle() -> None:
            """Off the clock: the deferred fingerprint's own time, read to its end."""
            while settled:
                pending, fresh = settled.pop()
                assert pending.wait(3600) and not pending.failed
                background.append(pending.seconds)
                shutil.rmtree(fresh, ignore_errors=True)

        remembered = DigestCache(root / "digests")
        fingerprint(root / "model", EXACT, remembered)  # what the first start leaves behind
        fingerprint(snapshot, EXACT, remembered)  # and its verified hub names
        assert fingerprint(root / "model", EXACT, remembered).hashed_bytes < (1 << 20), "restart hashed weights"
        cases = {  # name: (what to time, whether it reads every byte)
            "exact, first start": (first_start(root / "model"), True),
            "exact, first start, start path": (start_path(root / "model"), False),
            "exact, restart": (lambda: fingerprint(root / "model", EXACT, remembered), False),
            "exact, hub snapshot, first start": (first_start(snapshot), True),
            "exact, hub snapshot, restart": (lambda: fingerprint(snapshot, EXACT, remembered), False),
            "full (every start)": (lambda: fingerprint(root / "model", FULL), True),
            "sampled (every start)": (lambda: fingerprint(root / "model", SAMPLED), False),
        }
        print(f"{'kvstrata fingerprint':34} {'cache':5} {'resident':>8} {'seconds':>9} {'GB/s':>6} {'÷ vLLM load':>12}")
        for name, (action, reads_all) in cases.items():
            for cold_cache in (True, False):
                runs = []
                for _ in range(rounds):
                    runs.append(timed(action, files, cold_cache))
                    settle()
                seconds, resident = statistics.median(r[0] for r in runs), min(r[1] for r in runs)
                rate = f"{size / seconds / 1e9:6.1f}" if reads_all else "     -"
                print(f"{name:34} {'cold' if cold_cache else 'warm':5} {resident:8.1%} {seconds:9.4f} {rate} "
                      f"{seconds / load:12.2%}")
                if background:
                    print(f"{'  ... then in the background':34} {'':5} {'':8} {statistics.median(background):9.4f}")
                    background.clear()
    finally:
        shutil.rmtree(root, ignore_errors=True)


def sampled_coverage() -> None:
    """What `sampled` sees of a Llama-3-8B-shaped bfloat16 checkpoint, from its layout alone.

    Tensors in the order `save_pretrained` writes them, cut into shards of at most 5 GB,
    each shard's tensors by name as safetensors orders them (an approximation of the
    released files). An in-place edit keeps the identity when it touches no sampled byte."""
    config = dict(llama_config(16.0), vocab_size=128256, num_hidden_layers=32, num_key_value_heads=8)
    shards = shard_tensors(config, 5_000_000_000)

    spans: dict[str, tuple[int, int, tuple[int, ...], list[tuple[int, int]]]] = {}
    for tensors in shards:
        header = 8 + len(json.dumps({n: {"dtype": "BF16", "shape": list(s), "data_offsets": [0, 0]} for n, s in tensors}))
        offset = header
        for name, shape in sorted(tensors):
            nbytes = 2 * int(np.prod(shape))
            spans[name] = (offset, offset + nbytes, shape, [])
            offset += nbytes
        for name, _ in tensors:
            spans[name][3].extend(sampled_ranges(offset))

    def sampled_in(name: str, lo: int, hi: int) -> bool:
        start = spans[name][0]
        return any(a < start + hi and start + lo < a + n for a, n in spans[name][3])

    untouched = [n for n, (a, b, _, _) in spans.items() if not sampled_in(n, 0, b - a)]
    norms = [n for n in spans if "norm" in n]
    print(f"sampled on a Llama-3-8B-shaped bf16 checkpoint in {len(shards)} shards: "
          f"{len(untouched)} of {len(spans)} tensors never read, {len([n for n in norms if n in untouched])} "
          f"of {len(norms)} norms")  # fmt: skip
    for kind in ("mlp.down_proj", "self_attn.q_proj", "self_attn.k_proj", "input_layernorm"):
        names = [n for n in spans if kind in n]
        kept = sum(n in untouched for n in names) / len(names)
        print(f"  an in-place edit of one whole {kind} keeps the identity with probability {kept:.2f}")
    start, _, (rows, width), ranges = spans["model.embed_tokens.weight"]
    row_bytes = 2 * width
    sampled_rows = {
        row
        for a, n in ranges
        for row in range(max(0, (a - start) // row_bytes), min(rows, (a + n - 1 - start) // row_bytes + 1))
        if a + n > start
    }
    kept = math.comb(rows - len(sampled_rows), 100) / math.comb(rows, 100)  # 100 rows, none sampled
    print(f"  an in-place edit of 100 random embedding rows keeps it with probability {kept:.2f}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, nargs="+", default=[2.0], help="checkpoint sizes (default 2 GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per fingerprint case (medians reported)")
    parser.add_argument("--engine-max-gib", type=float, default=4.0,
                        help="start a whole vLLM engine only on checkpoints up to this size (it holds them in RAM)")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where to write the checkpoints")
    parser.add_argument("--coverage", action="store_true", help="only print what `sampled` reads of an 8B layout")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped run still removes its checkpoints
    if args.coverage:
        sampled_coverage()
        return
    print(f"{os.cpu_count()} CPUs; ÷ vLLM load: over vLLM's weight loader (engine start) where measured, "
          "else over its weights iterator + copy, both cold")  # fmt: skip
    for gib in args.gib:
        measure(gib, args.dir, args.rounds, args.engine_max_gib)


if __name__ == "__main__":
    main()
