"""The runtime of the exactness matrix: the Ray cluster, the stores, the engines, one cell.

See scripts/exactness_matrix.py for what a cell checks. Two simulated Ray nodes on this
machine: the engines run in this process's children and use the head node's store (arena,
disk, bucket); the second node's store (arena only) is the peer. All listeners on loopback;
everything made here (cluster, S3 server, /dev/shm and temporary directories) is ended here.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import exactness_design as design
import exactness_tiers as tiers
from exactness_checks import TOLERANCE, Outcome, computed_positions, first_difference, fmt, max_gap, same_engine, served_from
from exactness_models import MLA, SLIDING, build, build_lora

MiB = 1024**2
PHRASES = ["the cache keeps ", "every page ", "of the prompt ", "so that ", "a hit ", "gives back ", "what we computed; "]


@dataclass
class Result:
    ok: bool
    line: str


def token_ids(text: str) -> list[int]:
    from kvstrata._dev.testing import VOCAB

    index = {token: i for i, token in enumerate(VOCAB)}
    return [1] + [index[ch] for ch in text]  # BOS, then one token per character


def prompt(tag: str, tokens: int, seed: int) -> list[int]:
    """`tokens` token ids (BOS included) starting with a unique tag; phrases repeat, so
    n-gram speculation finds proposals."""
    rng = random.Random(seed)
    text = f"[{tag}] "
    while len(text) < tokens:
        text += rng.choice(PHRASES)
    return token_ids(text[: tokens - 1])


@dataclass
class Matrix:
    workdir: str | None = None
    need_peer: bool = True
    need_bucket: bool = True
    engine_starts: int = 0
    engine_seconds: float = 0.0
    references: dict[tuple, Outcome] = field(default_factory=dict)
    colds: dict[int, Outcome] = field(default_factory=dict)
    _fillers: int = 0
    _moves: int = 0  # chunk moves to the peer (move_to_peer)
    _retained: set = field(default_factory=set)  # chunks a disk cell retains (fill), released after it
    out: Any = None  # where the cell lines go (default: stdout)

    # -- setup -------------------------------------------------------------------------

    def __enter__(self) -> "Matrix":
        self._stack = contextlib.ExitStack()
        try:
            self._setup()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _setup(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        from kvstrata.actors.client import ensure_node_store, get_node_store

        root = Path(self.workdir) if self.workdir else Path(tempfile.mkdtemp(prefix="kvstrata-exact-"))
        if not self.workdir:
            self._stack.callback(shutil.rmtree, root, True)
        self.root = root
        shm = tempfile.mkdtemp(prefix="kvstrata-exact-", dir="/dev/shm")
        self._stack.callback(shutil.rmtree, shm, True)
        self.s3 = None
        if self.need_bucket:
            from kvstrata._dev.s3_server import LocalS3Server

            self.s3 = LocalS3Server(root / "seaweed").start(buckets=("kvstrata",))
            self._stack.callback(self.s3.stop)
        cluster = Cluster(initialize_head=False)
        self._stack.callback(cluster.shutdown)
        for node_args in [{"num_cpus": 2, "include_dashboard": False}] + ([{"num_cpus": 0}] if self.need_peer else []):
            for attempt in range(3):  # Ray gives a raylet 30 s to register: on a loaded machine, not always enough
                try:
                    cluster.add_node(**node_args)
                    break
                except Exception:  # noqa: BLE001 - "The current node timed out during startup"
                    if attempt == 2:
                        raise
        previous = os.environ.get("RAY_ADDRESS")
        os.environ["RAY_ADDRESS"] = cluster.address
        self._stack.callback(lambda: os.environ.__setitem__("RAY_ADDRESS", previous) if previous else os.environ.pop("RAY_ADDRESS", None))
        ray.init(address=cluster.address, namespace="kvstrata-exactness", log_to_driver=False)
        self._stack.callback(ray.shutdown)
        nodes = sorted(ray.nodes(), key=lambda node: not node.get("Resources", {}).get("CPU"))
        self.head = nodes[0]["NodeID"]
        self.peer = nodes[1]["NodeID"] if self.need_peer else None
        os.environ["KVSTRATA_NODE_ID"] = self.head  # the engines (this process's children) use the head's store
        self._stack.callback(os.environ.pop, "KVSTRATA_NODE_ID", None)
        self.config = self._config(shm, root / "disk", with_disk=True)
        from kvstrata.config import load_config

        ensure_node_store(load_config(self.config), self.head)
        if self.peer:
            ensure_node_store(load_config(self._config(shm, None, with_disk=False, with_bucket=False)), self.peer)
        self.store = get_node_store(self.head)
        ray.get(self.store.ping.remote(), timeout=120)
        self._stack.callback(self._stores_down)

    def _stores_down(self) -> None:
        from kvstrata.actors.client import get_node_store, shutdown_node_store

        for node in filter(None, [self.head, self.peer]):
            with contextlib.suppress(Exception):
                shutdown_node_store(get_node_store(node))

    def _config(self, shm: str, disk: Path | None, with_disk: bool, with_bucket: bool = True) -> dict[str, Any]:
        from kvstrata.tiers.disk import HEADER_BYTES

        tiers: dict[str, Any] = {"cpu": {"capacity": 4 * MiB, "segment_size": 1 * MiB, "shm_dir": shm}}
        if with_disk:
            disk.mkdir(parents=True, exist_ok=True)
            # 160 chunks of 128 KiB: two filler batches of the sliding model (2 x 4 x 7 chunks
            # in each of its two KV groups) fit beside a cell's chunks (96 did not, 28 Nov),
            # and ten batches of the dense model still push them off (the bucket cells).
            tiers["disk"] = {"path": str(disk), "capacity": 160 * (128 * 1024 + HEADER_BYTES)}
        if with_bucket and self.s3 is not None:
            tiers["object"] = {
                "url": "s3://kvstrata/exactness",
                "endpoint_url": self.s3.endpoint_url,
                "storage_options": self.s3.storage_options(),
                "index_refresh_seconds": 1,
            }
        config: dict[str, Any] = {
            "tiers": tiers,
            # No tolerated view age: the harness moves chunks between tiers behind the engine's back.
            # A request waits up to 30 s for a promotion (default 2 s): on two shared cores a
            # peer or bucket promotion took longer, and the hit became a (correct) miss.
            "engine": {"reserve_slots": 8, "max_view_age_seconds": 0, "control_timeout_seconds": 30, "lookup_wait_seconds": 30},
            "admission": {"load": "always"},  # the tiny model recomputes faster than any tier loads
        }
        if self.need_peer:
            config["cluster"] = {"directory_shards": 1, "sync_seconds": 0.1, "reconcile_seconds": 1}
        return config

    # -- engines ----------------------------------------------------------------------

    def engine_kwargs(self, model: str, tp: int, feature: str, lora: bool) -> tuple[Path, dict[str, Any]]:
        directory, extra = build(model, self.root / "models")
        kwargs: dict[str, Any] = dict(
            model=str(directory), block_size=16 if model == MLA else 32, max_model_len=1024, dtype="float32",
            enforce_eager=True, seed=0, **extra,
        )  # fmt: skip
        if tp == 2:
            kwargs.update(tensor_parallel_size=2, distributed_executor_backend="mp")
        if lora:
            kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=1)
        if feature == "chunked":
            kwargs.update(max_num_batched_tokens=40, enable_chunked_prefill=True)
        elif feature == "no-prefix-cache":
            kwargs.update(enable_prefix_caching=False)
        elif feature == "ngram":
            kwargs.update(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2})
        elif feature == "preempt":
            # 18 blocks (576 tokens) for three requests of ~250: vLLM needs one max_model_len of
            # room. MLA's blocks hold 16 tokens; the sliding model's two KV groups split the
            # blocks (34: vLLM's check then allows the 512 tokens of max_model_len).
            blocks = {MLA: 36, SLIDING: 34}.get(model, 18)
            kwargs.update(num_gpu_blocks_override=blocks, max_model_len=512)
        return directory, kwargs

    def start(self, kwargs: dict[str, Any], kvstrata: bool) -> Any:
        from vllm import LLM

        from kvstrata._dev.testing import kvstrata_transfer_config

        if kvstrata:
            kwargs = dict(kwargs, kv_transfer_config=kvstrata_transfer_config(self.config, block_size=design.CHUNK))
        started = time.monotonic()
        # vLLM binds each CPU worker's threads to a NUMA node of its own ("auto"), refused
        # with one node (this machine); one core per rank instead. Inherited at spawn.
        bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        if kwargs.get("tensor_parallel_size") == 2:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        try:
            llm = LLM(**kwargs)
        finally:
            if bind is None:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
            else:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
        self.engine_seconds += time.monotonic() - started
        self.engine_starts += 1
        return llm

    @staticmethod
    def stop(llm: Any) -> None:
        from kvstrata._dev.testing import shutdown_llm

        shutdown_llm(llm)

    def lora_request(self, model: str) -> Any:
        from vllm.lora.request import LoRARequest

        directory, _ = build(model, self.root / "models")
        return LoRARequest("exactness", 1, str(build_lora(directory, self.root / "models" / f"lora-{Path(directory).name}")))

    def generate(
        self, llm: Any, prompts: list[list[int]], salt: str | None = None, lora: Any = None, max_tokens: int = 12,
        checked: bool = True,
    ) -> list[Outcome]:
        """`checked=False`: filler and tick prompts, whose logprobs nobody reads."""
        from vllm import SamplingParams

        params = SamplingParams(
            # No prompt logprobs under LoRA: vLLM 0.32's CPU LoRA logits (punica_cpu.add_lora_logits)
            # crash the engine on the prompt logprobs of a hit (einsum size mismatch), and on
            # those of a batch of plain requests on a LoRA engine (the fillers, 28 Nov).
            max_tokens=max_tokens, temperature=0.0, logprobs=1 if checked else None,
            prompt_logprobs=1 if checked and not lora else None,
            ignore_eos=True, detokenize=False,
            skip_reading_prefix_cache=False,  # vLLM skips every cache for prompt logprobs unless told not to
        )  # fmt: skip
        inputs = [{"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})} for ids in prompts]
        outputs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
        return [Outcome.of(output) for output in outputs]

    # -- the run ----------------------------------------------------------------------

    def run(self, cells: list[design.Cell], groups: list) -> list[Result]:
        results: dict[int, Result] = {}
        index = {id(cell): i for i, cell in enumerate(cells)}
        by_model: dict[str, list] = {}
        for engine, members in groups:
            by_model.setdefault(engine[0], []).append((engine, members))
        for model, model_groups in by_model.items():
            model_cells = [cell for cell in cells if cell.model == model]
            try:
                self.compute_references(model, model_cells, index)
            except Exception as exc:  # noqa: BLE001 - every cell of the model fails, with the reason
                for cell in model_cells:
                    results[index[id(cell)]] = self.fail(index[id(cell)], cell, f"reference engine: {exc!r}")
                continue
            for (name, tp, feature), members in model_groups:
                needs_lora = feature == "lora"
                _, kwargs = self.engine_kwargs(name, tp, feature, needs_lora)
                tiers.clean_slate(self)  # what stopped engines left must not move this one's cells
                try:
                    llm = self.start(kwargs, kvstrata=True)
                except Exception as exc:  # noqa: BLE001
                    print(f"engine {name} tp={tp} {feature}: did not start: {type(exc).__name__}: {exc}", file=self.out or sys.stdout, flush=True)
                    for cell in members:
                        results[index[id(cell)]] = self.fail(index[id(cell)], cell, f"engine start: {type(exc).__name__}: {exc}")
                    continue
                try:
                    if tp == 2:  # the prompts TP 1 engines of this model will ask for
                        for cell in model_cells:
                            if cell.tp == "2>1":
                                self.compute_for_other(index[id(cell)], cell, llm)
                    # In design order: a connector reset starts a new namespace, and later cells
                    # of the engine must still store (a purged pool gives its segments back,
                    # tests/tiers/test_arena_idle_pools.py; the matrix found it starving).
                    for cell in members:
                        results[index[id(cell)]] = self.run_cell(index[id(cell)], cell, llm)
                finally:
                    self.stop(llm)
        return [results[i] for i in sorted(results)]

    def fail(self, i: int, cell: design.Cell, why: str) -> Result:
        line = f"cell {i:3d} FAIL {cell.label()}: {why}"
        print(line, file=self.out or sys.stdout, flush=True)
        return Result(False, line)

    def prompts_of(self, i: int, cell: design.Cell) -> tuple[list[int], list[int]]:
        served_len, computed_len = design.prompt_tokens(cell.length)
        served = prompt(f"cell {i}", served_len, seed=i)
        return served, served[:computed_len] if computed_len else served

    def compute_references(self, model: str, cells: list[design.Cell], index: dict[int, int]) -> None:
        """Every prompt of `model`'s cells on one engine without any connector."""
        lora_cells = [c for c in cells if c.feature == "lora"]
        _, kwargs = self.engine_kwargs(model, 1, "none", lora=bool(lora_cells))
        llm = self.start(kwargs, kvstrata=False)
        try:
            lora = self.lora_request(model) if lora_cells else None
            for cell in cells:
                i = index[id(cell)]
                served, _ = self.prompts_of(i, cell)
                if cell.feature == "lora":
                    (self.references[(i, "lora")],) = self.generate(llm, [served], lora=lora)
                (self.references[(i, None)],) = self.generate(llm, [served])
        finally:
            self.stop(llm)

    # -- store views ------------------------------------------------------------------

    def snapshot(self, medium: str = "CPU", namespaces: Any = None) -> set[tuple[str, bytes]]:
        import ray

        namespaces = sorted(namespaces or ray.get(self.store.stats.remote())["pools"])
        keys = ray.get([self.store.keys.remote(ns, medium) for ns in namespaces])
        return {(ns, key) for ns, ns_keys in zip(namespaces, keys) for key in ns_keys}

    def chunk_bytes(self, chunks: set[tuple[str, bytes]]) -> dict[bytes, bytes]:
        """The bytes this node's arena holds for `chunks` (those it holds), by key."""
        import numpy
        import ray

        held: dict[bytes, bytes] = {}
        for namespace in {ns for ns, _ in chunks}:
            keys = [key for ns, key in chunks if ns == namespace]
            found, _, arrays = ray.get(self.store.export_chunks.remote(namespace, keys), timeout=60)
            held.update((key, numpy.asarray(array).tobytes()) for key, array in zip(found, arrays))
        return held

    def settle(self, llm: Any, before: set, want: int) -> set[tuple[str, bytes]]:
        """The chunks the last compute committed: step the engine (a prompt shorter than a
        chunk stores nothing) until at least `want` new chunks are in the arena and no more come."""
        import ray

        new: set = set()
        for attempt in range(12):
            ray.get(self.store.wait_io.remote(60))
            now = self.snapshot() - before
            if len(now) >= want and now == new:
                return now
            new = now
            self.tick(llm, seed=attempt)
        return new

    def tick(self, llm: Any, seed: int = 0) -> None:
        """One engine step on a 12-token prompt never seen before: shorter than a chunk, so
        it stores nothing; what the engine had pending (commits, idle pins) moves on."""
        self.generate(llm, [prompt(f"tick {time.monotonic_ns()}", 12, seed=seed)], max_tokens=1, checked=False)

    def filler(self, llm: Any) -> None:
        """A prompt of 7 whole chunks never seen before, computed and stored: it pushes
        older chunks down the cascade."""
        self._fillers += 1
        filler = prompt(f"filler {self._fillers}", 7 * design.CHUNK, seed=1000 + self._fillers)
        self.generate(llm, [filler], max_tokens=1, checked=False)

    # -- one cell ---------------------------------------------------------------------

    def compute_for_other(self, i: int, cell: design.Cell, llm: Any) -> None:
        """A `2>1` cell's prompt, computed and stored by this TP 2 engine."""
        _, computed = self.prompts_of(i, cell)
        before = self.snapshot()
        (self.colds[i],) = self.generate(llm, [computed])
        self.settle(llm, before, len(computed) // design.CHUNK)
        self.other_chunks = getattr(self, "other_chunks", {})
        self.other_chunks[i] = self.snapshot() - before

    def run_cell(self, i: int, cell: design.Cell, llm: Any) -> Result:
        started = time.monotonic()
        try:
            ok, detail = self._cell(i, cell, llm)
        except Exception as exc:  # noqa: BLE001 - a cell that raises has failed; the matrix goes on
            ok, detail = False, f"{type(exc).__name__}: {exc} | {traceback.format_exc(limit=-1).strip().splitlines()[-2].strip()}"
        finally:
            if self._retained:
                tiers.retain(self, set(self._retained), priority=0)
        line = f"cell {i:3d} {'ok  ' if ok else 'FAIL'} {cell.label()}: {detail} ({time.monotonic() - started:.1f} s)"
        print(line, file=self.out or sys.stdout, flush=True)
        return Result(ok, line)

    def _cell(self, i: int, cell: design.Cell, llm: Any) -> tuple[bool, str]:
        import ray

        served, computed = self.prompts_of(i, cell)
        salt = f"tenant-{i}" if cell.feature == "cache-salt" else None
        lora = self.lora_request(cell.model) if cell.feature == "lora" else None
        reference = self.references[(i, "lora" if lora else None)]
        prefix_caching = cell.feature != "no-prefix-cache"
        expected = design.expected_hit(cell.length, cell.model)
        if cell.model == MLA:
            expected = 0  # kvstrata is off for vLLM's CPU MLA: no cached prefix there (compat.cached_prefix_unsupported)
        problems: list[str] = []

        # 1. Computed once (stored), unless a TP 2 engine did it already.
        if cell.tp == "2>1":
            if i not in self.colds:
                return False, "no TP 2 engine computed its prompt (see its engine's start above)"
            cold, chunks = self.colds[i], self.other_chunks[i]
            expected = 0  # another TP size is another layout namespace: a miss, never its bytes
        else:
            before = self.snapshot()
            (cold,) = self.generate(llm, [computed], salt=salt, lora=lora)
            chunks = self.settle(llm, before, len(computed) // design.CHUNK)
        if expected and not chunks:
            return False, "the compute stored no chunk"
        stored = self.chunk_bytes(chunks) if cell.tp != "2>1" else {}
        own = None
        if prefix_caching and computed is served and cell.tp != "2>1" and cell.feature != "preempt":
            # vLLM's own prefix-cache hit over the cold pass's KV: the kernels a kvstrata hit
            # runs (the tokens after the cached ones as their own step), over vLLM's own bytes.
            (own,) = self.generate(llm, [served], salt=salt, lora=lora)

        # 2. The tier under test becomes the only one holding the chunks.
        peer_before = None
        if cell.feature == "reset":
            # vLLM's reset with the connector: kvstrata drops the namespace, so the next
            # request is a miss, which must still give the right answer.
            llm.reset_prefix_cache(reset_connector=True)
            expected = 0
        elif cell.tp != "2>1":
            # (2>1: the TP 2 engine's chunks are another namespace's, which this engine never
            # asks for; once that engine stopped, its abandoned pool may have drained to disk.)
            # A peer's promotions count from before the move (which promotes nothing), so a
            # promotion that starts before the hit does (a lookup or prefetch that heard the
            # directory's news first): two cells of the 28 Nov run counted none for a hit of
            # the right length with exact bytes and nothing left here after the purge. Not
            # reproduced since (a rerun of every sliding TP 2 cell counted each one).
            peer_before = ray.get(self.store.stats.remote()) if cell.tier == "peer" else None
            why = tiers.force_tier(self, llm, cell.tier, chunks)
            if why:
                return False, f"setup: {why}"
        if prefix_caching:
            llm.reset_prefix_cache()  # vLLM's own cache: what it holds must come from kvstrata
        before_stats = peer_before or ray.get(self.store.stats.remote())

        # 3. Served again (preempt: as the last of three requests on an 18-block KV cache).
        if cell.feature == "preempt":
            others = [prompt(f"cell {i} other {j}", 200, seed=500 + i * 2 + j) for j in range(2)]
            outcomes = self.generate(llm, others + [served], max_tokens=24)
            hit = outcomes[-1]
            hit.tokens, hit.logprobs = hit.tokens[:12], hit.logprobs[:12]
        else:
            (hit,) = self.generate(llm, [served], salt=salt, lora=lora)
        after_stats = ray.get(self.store.stats.remote())

        # 4. Checks.
        if hit.tokens != reference.tokens:
            problems.append(f"tokens differ from the reference at step {first_difference(hit.tokens, reference.tokens)}")
        gap = max_gap(reference.logprobs, hit.logprobs)
        prompt_gap = max_gap(reference.prompt_logprobs, computed_positions(hit, len(served)))
        if gap is None or gap > TOLERANCE:
            problems.append(f"sampled logprobs off the reference by {gap}")
        if prompt_gap is None or prompt_gap > TOLERANCE:
            problems.append(f"prompt logprobs off the reference by {prompt_gap}")
        # Preempt: the other two requests' stores may push the hit's last chunks out of the
        # 4 MiB arena before it is scheduled (or rescheduled): a shorter hit of whole chunks,
        # still a hit, is right there; its answer is held to the same checks.
        partial_ok = cell.feature == "preempt" and 0 < hit.cached < expected and hit.cached % design.CHUNK == 0
        if hit.cached != expected and not partial_ok:
            problems.append(f"cached {hit.cached} tokens, expected {expected}")
        bytes_exact = False
        if stored and expected:
            # What the hit loaded from: the chunks this node's arena holds after it (promoted
            # from the tier under test) must be the bytes the compute stored, bit for bit.
            arrived = self.chunk_bytes(chunks)
            changed = sorted(key.hex()[:12] for key in stored if key in arrived and arrived[key] != stored[key])
            if changed:
                problems.append(f"chunk bytes changed on the way through {cell.tier}: {changed}")
            bytes_exact = not changed and set(stored) <= set(arrived)
        same, problem = same_engine(cell, cold, own, hit, served, computed is served, bytes_exact)
        if problem:
            problems.append(same)
        served_by = served_from(before_stats, after_stats)
        if expected and cell.tier != "arena" and cell.feature != "reset" and not served_by:
            problems.append("no promotion counted from the tier")

        # 5. Controls: another tenant's salt and the base model do not get these chunks.
        if cell.feature == "cache-salt":
            llm.reset_prefix_cache()
            (other,) = self.generate(llm, [served], salt=f"other-{i}")
            if other.cached or other.tokens != reference.tokens:
                problems.append(f"another salt: cached {other.cached}, tokens {'equal' if other.tokens == reference.tokens else 'differ'}")
        if cell.feature == "lora":
            llm.reset_prefix_cache()
            (base,) = self.generate(llm, [served])
            base_ref = self.references[(i, None)]
            if base.cached or base.tokens != base_ref.tokens:
                problems.append(f"without the adapter: cached {base.cached}, tokens {'equal' if base.tokens == base_ref.tokens else 'differ'}")
        detail = f"cached {hit.cached}/{expected}, ref gap {fmt(gap)} / prompt {fmt(prompt_gap)}, {same}, {served_by or 'arena'}"
        return not problems, detail if not problems else "; ".join(problems) + f" [{detail}]"
