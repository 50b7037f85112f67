"""The soak: one engine, a working set several times the arena, rounds until the time
is up, and the store's footprint sampled after every round.

What passes: nothing the store owns keeps growing once the working set has been seen.
The first third of the samples is warm-up (pools grow, the disk tier fills); the
maximum of each figure over the last third may exceed its maximum over the middle third
by at most a small tolerance (`Tolerances`), the arena's files never exceed its
capacity nor the disk's bytes its capacity, the hit rate of the last third does not
fall, and every request's tokens equal those of its first (cold) run.

The working set is cut into fixed batches of PER_ROUND prompts and each round runs one
of them, chosen at random: a request is compared with its own first run in the same
batch (a batch that fits the arena comes back whole; whether vLLM itself is invariant
across batch shapes is measured apart, by scripts/vllm_prefix_invariance.py).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvstrata._dev.faults import load
from kvstrata._dev.faults.context import SLOT, RowContext
from kvstrata._dev.faults.probes import directory_bytes, disk_tier_bytes, sample_process

WORKING_SET = 24  # prompts of ~10 chunks: 240 chunks, three times the arena
PER_ROUND = 6
ARENA_SLOTS = 80  # a round's 60 chunks and the engine's reserve fit: promotions from disk become hits


@dataclass(frozen=True)
class SoakSample:
    """The store and its tiers after one round."""

    seconds: float
    rss_bytes: int
    fds: int
    threads: int
    shm_bytes: int
    disk_bytes: int
    hit_fraction: float
    round_seconds: float


@dataclass(frozen=True)
class Tolerances:
    """Growth from the middle third to the last that still counts as level: allocator and
    Ray buffer noise, not a leak per round (which over a soak's rounds grows far past it)."""

    rss_bytes: int = 64 << 20
    fds: int = 16
    threads: int = 8
    hit_fraction: float = 0.1


@dataclass
class SoakResult:
    samples: list[SoakSample] = field(default_factory=list)
    requests: int = 0
    failed: int = 0
    changed: int = 0
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.problems or self.failed or self.changed)

    def as_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def levelling_problems(
    samples: list[SoakSample], shm_capacity: int, disk_capacity: int, tolerances: Tolerances = Tolerances()
) -> list[str]:
    """Why `samples` do not level off (empty when they do)."""
    if len(samples) < 6:
        return [f"only {len(samples)} samples: too short a soak to tell growth from warm-up"]
    third = len(samples) // 3
    middle, last = samples[third : 2 * third], samples[2 * third :]
    problems = []
    for name, tolerance, unit in (("rss_bytes", tolerances.rss_bytes, 1 << 20), ("fds", tolerances.fds, 1), ("threads", tolerances.threads, 1)):
        before, after = max(getattr(s, name) for s in middle), max(getattr(s, name) for s in last)
        if after - before > tolerance:
            problems.append(f"store {name} keeps growing: {before // unit} -> {after // unit} (middle third -> last)")
    if (shm := max(s.shm_bytes for s in samples)) > shm_capacity:
        problems.append(f"arena files {shm >> 20} MiB over its {shm_capacity >> 20} MiB capacity")
    if (disk := max(s.disk_bytes for s in samples)) > disk_capacity:
        problems.append(f"disk tier {disk >> 20} MiB over its {disk_capacity >> 20} MiB capacity")
    hit_before = sum(s.hit_fraction for s in middle) / len(middle)
    hit_after = sum(s.hit_fraction for s in last) / len(last)
    if hit_after < hit_before - tolerances.hit_fraction:
        problems.append(f"hit rate falls: {hit_before:.2f} -> {hit_after:.2f} (middle third -> last)")
    return problems


def run_soak(model: Path, minutes: float, seed: int = 0, on_sample: Callable[[SoakSample], None] | None = None) -> SoakResult:
    """Soak one engine with arena + disk for `minutes`; never raises past its own cleanup."""
    from kvstrata._dev.faults.harness import settle, take_store_down
    from kvstrata._dev.faults.rows import store_pid
    from kvstrata._dev.testing import make_llm, shutdown_llm

    ctx = RowContext.create("soak")
    result = SoakResult()
    llm = None
    try:
        config = ctx.disk_config()
        config["tiers"]["cpu"] = ctx.arena(ARENA_SLOTS)
        llm = make_llm(model, config)
        working_set = load.prompts(WORKING_SET, seed=seed)
        batches = [working_set[i : i + PER_ROUND] for i in range(0, WORKING_SET, PER_ROUND)]
        first_tokens: dict[int, list[list[int]]] = {}
        rng = random.Random(seed)
        started = time.monotonic()
        while time.monotonic() - started < minutes * 60:
            which = rng.randrange(len(batches))
            round_ = load.run_round(llm, batches[which])
            result.requests += round_.sent
            result.failed += round_.failed
            reference = first_tokens.setdefault(which, round_.token_ids)
            changed = load.changed_outputs(reference, round_)
            result.changed += len(changed)
            result.notes += [f"round {len(result.samples) + 1}: a request with {round_.cached_per_request[i]} tokens cached changed" for i in changed]
            settle()
            process = sample_process(store_pid())
            if process is None:
                result.problems.append("the node store died")
                break
            sample = SoakSample(
                round(time.monotonic() - started, 1),
                process.rss_bytes,
                process.fds,
                process.threads,
                directory_bytes(ctx.shm_dir),
                disk_tier_bytes(ctx.disk_dir),
                round(round_.hit_fraction, 3),
                round(round_.seconds, 2),
            )
            result.samples.append(sample)
            if on_sample is not None:
                on_sample(sample)
        result.problems += levelling_problems(result.samples, ARENA_SLOTS * SLOT, ctx.disk_capacity())
    finally:
        if llm is not None:
            shutdown_llm(llm)
        take_store_down()
        ctx.close()
    return result
