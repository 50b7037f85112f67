"""Runs one fault row: fresh engine(s) and node store, a client load, the fault, recovery.

Every row goes the same way:
1. start the row's tier config (a fresh store: the previous row's was taken down) and
   its engine(s) on the tiny model;
2. round 1: every prompt at once (they are stored); round 2 after a prefix-cache reset
   (they are loaded). The fault is injected while the round its row names is in flight
   (a fixed delay into it: the rounds are long enough that it lands mid-round, and the
   row records whether it did) or between the two rounds;
3. the fault is lifted, then rounds run until every prompt's whole prefix is a kvstrata
   hit again: the time from the lift to the end of that round is "hits back after";
4. every completed request's tokens are compared with a fault-free reference; the store's
   RSS, fds and threads after recovery with those after round 1; the arena's shm_dir must
   be empty and the disk tier within its capacity after the row.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata._dev.faults import diagnose, load
from kvstrata._dev.faults.context import RowContext
from kvstrata.config import ObjectTierConfig
from kvstrata._dev.faults.probes import (
    ProcessSample,
    arena_fd_bound,
    directory_files,
    disk_tier_bytes,
    fd_kinds,
    growth_problems,
    kinds_growth,
    object_pool_fd_bound,
    object_pool_growth,
    sample_process,
)
from kvstrata._dev.faults.rows import (
    CONTROL_OF,
    CONTROLS,
    Fault,
    _noop,
    batch_size,
    store_pid,
    tier_config,
    victim_script,
    with_controls,
)

logger = logging.getLogger(__name__)

PROMPTS = 12  # requests in flight per round (per engine)
INJECT_DELAY_S = 0.1  # into the round: past its first scheduler steps (its loads), before its end
RECOVERY_LIMIT_S = 120.0
CONTROL_ROUNDS = 3  # rounds after round 2 of a control row: its steady hit rate is their lowest
HIT_TOLERANCE = 0.05  # a fault row's hits are back at its control's steady rate less this
VICTIM_START_LIMIT_S = 240.0


@dataclass
class RowResult:
    name: str
    summary: str = ""
    skipped: str = ""
    sent: int = 0
    completed: int = 0
    failed: int = 0
    changed: int = 0
    wrong_bytes: int = 0  # promotions the chunk audit refused: bytes no commit of their key had
    injected_mid_round: bool | None = None
    recovery_s: float | None = None
    leaks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str = ""
    hits: list[float] = field(default_factory=list)  # every round's hit fraction, in order
    target_hit: float = 0.999
    steady_hit: float | None = None  # control rows: what the tier config delivers with no fault
    store_after: dict[str, int] | None = None
    store_fd_kinds: dict[str, int] = field(default_factory=dict)  # what store_after's descriptors are

    @property
    def ok(self) -> bool:
        if self.skipped:
            return True
        return not (self.failed or self.changed or self.wrong_bytes or self.leaks or self.error) and self.recovery_s is not None

    def add(self, rounds: list[load.Round], reference: list[list[int]]) -> None:
        for number, round_ in enumerate(rounds, 1):
            self.sent += round_.sent
            self.completed += round_.completed
            self.failed += round_.failed
            changed = load.changed_outputs(reference, round_)
            self.changed += len(changed)
            self.notes += [f"round {number} request {i} changed ({round_.cached_per_request[i]} tokens cached)" for i in changed]
            if round_.error:
                self.notes.append(round_.error)


def reference_tokens(model: Path, ctx_factory=RowContext.create) -> list[list[int]]:
    """The greedy tokens of every prompt, computed with kvstrata but nothing to load."""
    from kvstrata._dev.testing import make_llm, shutdown_llm

    ctx = ctx_factory("reference")
    llm = make_llm(model, ctx.arena_config())
    try:
        return load.run_round(llm, load.prompts(PROMPTS)).token_ids
    finally:
        shutdown_llm(llm)
        take_store_down()
        ctx.close()


def take_store_down() -> None:
    from kvstrata.actors.client import StoreUnavailable, get_node_store, shutdown_node_store

    with contextlib.suppress(StoreUnavailable):
        shutdown_node_store(get_node_store())


def settle(timeout_s: float = 60.0) -> None:
    """Let the store finish background writes, uploads and promotions (bounded; a store
    that is restarting or stuck behind a fault is not waited for)."""
    import ray

    from kvstrata.actors.client import get_node_store

    with contextlib.suppress(Exception):
        ray.get(get_node_store().wait_io.remote(timeout_s), timeout=timeout_s + 10)


def _store_sample(arena_dir: Path | None = None):
    with contextlib.suppress(Exception):
        return sample_process(store_pid(), arena_dir)
    return None


def _store_fd_kinds() -> dict[str, int]:
    with contextlib.suppress(Exception):
        return fd_kinds(store_pid())
    return {}


def _store_stats() -> dict[str, Any]:
    import ray

    from kvstrata.actors.client import get_node_store

    return ray.get(get_node_store().stats.remote(), timeout=30)


def _store_audit() -> dict[str, int] | None:
    """The chunk audit's counters of the store now running (since its last start)."""
    with contextlib.suppress(Exception):
        return _store_stats()["audit"]
    return None


def _engines_in_report() -> dict[str, Any]:
    return _store_stats()["report"]["engines"]


def _round(llms: list, batches: list[list[str]], fault: Fault | None, ctx: RowContext, result: RowResult) -> list[load.Round]:
    """One round (its batches in turn) on every engine at once; `fault` injected
    INJECT_DELAY_S into it."""
    rounds: list[load.Round | None] = [None] * len(llms)
    started = threading.Barrier(len(llms) + 1)

    def drive(index: int) -> None:
        started.wait(timeout=60)
        rounds[index] = load.run_batches(llms[index], batches)

    threads = [threading.Thread(target=drive, args=(i,), name=f"fault-load-{i}") for i in range(len(llms))]
    for thread in threads:
        thread.start()
    started.wait(timeout=60)
    if fault is not None:
        time.sleep(INJECT_DELAY_S)  # the injection point itself, not a synchronisation
        fault.inject(ctx)
        result.injected_mid_round = any(thread.is_alive() for thread in threads)
    for thread in threads:
        thread.join(timeout=600)
    return [r for r in rounds if r is not None]


def _start_victim(ctx: RowContext, model: Path, config: dict) -> subprocess.Popen:
    script = ctx.workdir / "victim.py"
    script.write_text(victim_script(model, config))
    log = open(ctx.workdir / "victim.log", "wb")  # noqa: SIM115 - closed with the row's workdir
    # The script lives in the row's workdir: import this very kvstrata, wherever it is installed from.
    package_root = str(Path(__file__).resolve().parents[3])  # the repository: kvstrata/_dev/faults/harness.py
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
    process = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=log, start_new_session=True, cwd=os.getcwd(), env=env
    )
    ctx.state["victim"] = process
    deadline = time.monotonic() + VICTIM_START_LIMIT_S
    for line in process.stdout:  # the victim prints one line once its engine serves
        if b"victim ready" in line:
            return process
        if time.monotonic() > deadline:
            break
    log.flush()
    tail = (ctx.workdir / "victim.log").read_text(errors="replace")[-600:]
    raise RuntimeError(f"the second engine did not start (exit {process.poll()}): ...{tail}")


def _kill_victim(ctx: RowContext) -> None:
    """SIGKILL the victim engine's whole process group, then remove the vLLM shared memory
    its processes mapped (their resource tracker died with them)."""
    from kvstrata._dev.testing import VLLM_SHM_PREFIXES, _unlink_unmapped, process_tree, shared_memory_of

    process: subprocess.Popen = ctx.state["victim"]
    mapped = {p for p in shared_memory_of(process_tree(process.pid)) if p.name.startswith(VLLM_SHM_PREFIXES)}
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
    ctx.state["victim_shm"] = mapped


def run_row(
    fault: Fault,
    model: Path,
    reference: list[list[int]],
    control: RowResult | None = None,
    min_rounds: int = 0,
    diagnose_leaks: bool = False,
) -> RowResult:
    """Run one fault row end to end; never raises (an error is the row's result).

    `control` is the fault-free row of the same tier config, run earlier in the same
    session: its steady hit rate is what "hits are back" means here (an arena smaller
    than a round's working set never serves every chunk, fault or not), and its store's
    footprint after its rounds is what this row's store is compared with for leaks (a
    tier that came up late starts its threads and connections late, not leaked).

    `min_rounds`: keep running fault-free rounds after the hits are back until the row has
    run this many (per engine), to look for rare changed outputs.

    `diagnose_leaks`: trace the store's allocations from the baseline on and note its
    footprint after every round, and what grew (diagnose.py); a descriptor leak's kinds
    are noted in any case.
    """
    from kvstrata._dev.testing import _unlink_unmapped, make_llm, shutdown_llm

    result = RowResult(fault.name, fault.summary)
    if control is not None and control.steady_hit is not None:
        result.target_hit = round(max(0.0, control.steady_hit - HIT_TOLERANCE), 3)
    if reason := fault.skip_reason():
        result.skipped = reason
        return result
    ctx = RowContext.create(fault.name)
    llms: list = []
    sampler = diagnose.PeakSampler(store_pid) if diagnose_leaks else None

    def phase(name: str) -> None:
        if sampler is not None:
            sampler.phase = name

    try:
        config = tier_config(fault, ctx)
        llms.append(make_llm(model, config))
        if fault.tiers == "two-engines":
            llms.append(make_llm(model, config))
        if fault.tiers == "engine-kill":
            _start_victim(ctx, model, config)
            fault = Fault(fault.name, fault.summary, fault.tiers, fault.during, inject=_kill_victim_recording)
        prompts = load.prompts(PROMPTS)
        size = batch_size(fault) or PROMPTS
        batches = [prompts[i : i + size] for i in range(0, PROMPTS, size)]
        phase("round 1")
        rounds = _round(llms, batches, fault if fault.during == "stores" else None, ctx, result)
        settle()
        before, before_kinds = _store_sample(ctx.shm_dir), _store_fd_kinds()
        if diagnose_leaks:
            diagnose.start_tracing()
        if fault.during == "between":
            fault.inject(ctx)
        phase("round 2")
        rounds += _round(llms, batches, fault if fault.during == "loads" else None, ctx, result)
        if diagnose_leaks and fault.lift is not _noop:
            held = diagnose.memory_growth(stop=False)
            result.notes += [f"store memory while the fault holds: {line}" for line in held]
        phase("recovery")
        fault.lift(ctx)
        lifted = time.monotonic()
        if fault.name in CONTROLS:
            # A control's own baseline is its store once round 2 has loaded: a tier's
            # client pools (S3 connections, their threads) open on first use, not leak.
            settle()
            before, before_kinds = _store_sample(ctx.shm_dir) or before, _store_fd_kinds() or before_kinds
            if diagnose_leaks:
                diagnose.start_tracing()
            for _ in range(CONTROL_ROUNDS):
                settle()
                rounds += _round(llms, batches, None, ctx, result)
            result.recovery_s = 0.0
            result.steady_hit = round(min(r.hit_fraction for r in rounds[-CONTROL_ROUNDS * len(llms) :]), 3)
        while result.recovery_s is None and time.monotonic() - lifted < RECOVERY_LIMIT_S:
            settle()
            recovery = _round(llms, batches, None, ctx, result)
            rounds += recovery
            if diagnose_leaks and (sample := _store_sample()):
                result.notes.append(f"after round {len(rounds) // len(llms)}: RSS {sample.rss_bytes >> 20} MiB, {sample.fds} fds")
            if all(r.hit_fraction >= result.target_hit for r in recovery) and _victim_gone(ctx):
                result.recovery_s = round(time.monotonic() - lifted, 1)
        while len(rounds) < min_rounds * len(llms):
            rounds += _round(llms, batches, None, ctx, result)
        result.hits = [round(r.hit_fraction, 3) for r in rounds]
        result.add(rounds, reference)
        settle()
        audit = _store_audit()
        if audit:
            result.wrong_bytes = audit["audit_mismatches"]
            result.notes.append(
                f"audit: {audit['audit_promotions_checked']} promotions checked, {audit['audit_mismatches']} wrong, "
                f"{audit['audit_recommits_differing']} keys recommitted with other bytes"
            )
        after, after_kinds = _store_sample(ctx.shm_dir), _store_fd_kinds()
        if after is not None:
            result.store_after = after.as_dict()
            result.store_fd_kinds = after_kinds
        # Against the control's store where the row runs the control's shape; two engines
        # hold more connections by design: their own store after round 1 is the baseline
        # there. The arena's segment descriptors are held to the arena's own bound instead
        # (probes.arena_fd_bound): it opens them as it fills, in round 1 or only later.
        same_shape = fault.tiers != "two-engines"
        use_control = same_shape and control is not None and control.store_after
        baseline = ProcessSample(**control.store_after) if use_control else before
        baseline_kinds = control.store_fd_kinds if use_control else before_kinds
        if baseline and after:
            arena = config["tiers"]["cpu"]
            pool = None
            if "object" in config["tiers"] and ctx.proxy is not None:  # every object row's endpoint is the proxy
                default = ObjectTierConfig.model_fields["max_concurrency"].default
                concurrency = config["tiers"]["object"].get("max_concurrency", default)
                grown_pool = object_pool_growth(baseline_kinds or {}, after_kinds or {}, ctx.proxy.port)
                pool = (grown_pool, object_pool_fd_bound(concurrency))
            grown = growth_problems(
                baseline, after, arena_fds_bound=arena_fd_bound(arena["capacity"], arena["segment_size"]), object_pool=pool
            )
            result.leaks += grown
            if diagnose_leaks or any("fds" in problem or "descriptors" in problem for problem in grown):
                result.notes.append(f"store descriptors since the baseline: {kinds_growth(baseline_kinds, after_kinds)}")
        if diagnose_leaks:
            result.notes += [f"store memory since the baseline: {line}" for line in diagnose.memory_growth()]
        disk_used = disk_tier_bytes(ctx.disk_dir)
        if disk_used > ctx.disk_capacity():
            result.leaks.append(f"disk slabs {disk_used >> 10} KiB over the tier's {ctx.disk_capacity() >> 10} KiB capacity")
        for key in ("damaged", "killed_store_pid"):
            if key in ctx.state:
                result.notes.append(f"{key}={ctx.state[key]}")
        if ctx.proxy is not None and ctx.proxy.answered_503:
            result.notes.append(f"503s={ctx.proxy.answered_503}")
    except Exception as error:  # noqa: BLE001 - a row that breaks the harness is a failed row
        logger.exception("fault row %s failed", fault.name)
        result.error = f"{type(error).__name__}: {error}"[:300]
    finally:
        if sampler is not None:
            result.notes.append(sampler.close())
        for llm in llms:
            with contextlib.suppress(Exception):
                shutdown_llm(llm)
        if "victim" in ctx.state and ctx.state["victim"].poll() is None:
            _kill_victim(ctx)
        _unlink_unmapped(ctx.state.get("victim_shm", set()))
        take_store_down()
        left = [p.name for p in directory_files(ctx.shm_dir) if p.name != "filler.bin"]
        if left:
            result.leaks.append(f"{len(left)} arena files left in shm_dir")
        ctx.close()
    return result


def _kill_victim_recording(ctx: RowContext) -> None:
    engines = _engines_in_report()
    ctx.state["victim_pins"] = sum(e["pinned"] for e in engines.values())
    ctx.state["engines_before_kill"] = set(engines)
    _kill_victim(ctx)


def _victim_gone(ctx: RowContext) -> bool:
    """For the engine-kill row: the dead engine's lease expired and the store took back its
    pins and reservations (only the survivor is left in the store's report)."""
    if "engines_before_kill" not in ctx.state:
        return True
    with contextlib.suppress(Exception):
        return len(_engines_in_report()) < len(ctx.state["engines_before_kill"])
    return False


def run_rows(
    names: list[str], progress: Callable[[str], None] | None = None, min_rounds: int = 0, diagnose_leaks: bool = False
) -> list[RowResult]:
    """Run the named single-node rows in one fault session (one model, one Ray cluster)."""
    from kvstrata._dev.faults.rows import by_name
    from kvstrata._dev.faults.session import fault_session

    results: list[RowResult] = []
    controls: dict[str, RowResult] = {}
    with fault_session("kvstrata-fault-matrix") as model:
        reference = reference_tokens(model)
        for fault in with_controls(by_name(names)):
            if progress is not None:
                progress(fault.name)
            control = controls.get(CONTROL_OF[fault.tiers])
            result = run_row(fault, model, reference, control, min_rounds, diagnose_leaks)
            if fault.name in CONTROLS and result.ok:
                controls[fault.name] = result
            results.append(result)
    return results
