"""The axes of the exactness matrix and a seeded covering design over them.

A cell is one value of each axis. `--full` runs every applicable cell; the default runs a
covering design: every pair of values of any two axes appears in at least one cell (where
some applicable cell has that pair). Cells that need the same engine (model, parallelism and
the engine-level feature) run on one engine, so the design is built to need few engines:
a candidate cell that needs a new engine is chosen only when no cell of an existing one
covers as much.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass

from exactness_models import DENSE, FP8, HYBRID_SSM, MLA, SLIDING

CHUNK = 64  # tokens per kvstrata chunk: two vLLM blocks of 32
BLOCK = 32
CHUNKS = 3  # the boundary prompts are around CHUNKS * CHUNK tokens

MODELS = [DENSE, SLIDING, FP8, HYBRID_SSM, MLA]
TPS = ["1", "2", "2>1"]  # "2>1": a TP 1 engine asks for what a TP 2 engine stored
TIERS = ["arena", "disk", "bucket", "peer"]
LENGTHS = ["short", "kC-1", "kC", "kC+1", "kC+block", "extend"]
FEATURES = ["none", "chunked", "no-prefix-cache", "ngram", "cache-salt", "lora", "reset", "preempt"]
# Features that need an engine of their own; the others are per request on the plain engine.
ENGINE_FEATURES = {"chunked", "no-prefix-cache", "ngram", "lora", "preempt"}

AXES = {"model": MODELS, "tp": TPS, "tier": TIERS, "length": LENGTHS, "feature": FEATURES}


@dataclass(frozen=True)
class Cell:
    model: str
    tp: str
    tier: str
    length: str
    feature: str

    def engine(self) -> tuple[str, int, str]:
        """What the kvstrata engine serving the hit is: model, TP size, engine feature."""
        return self.model, 1 if self.tp in ("1", "2>1") else 2, self.feature if self.feature in ENGINE_FEATURES else "none"

    def label(self) -> str:
        return f"model={self.model} tp={self.tp} tier={self.tier} length={self.length} feature={self.feature}"


def prompt_tokens(length: str) -> tuple[int, int | None]:
    """(tokens of the prompt served from the tier, tokens of the prompt computed first if
    it is another one: the cached prefix of an extension)."""
    k = CHUNKS * CHUNK
    return {
        "short": (CHUNK - 24, None),
        "kC-1": (k - 1, None),
        "kC": (k, None),
        "kC+1": (k + 1, None),
        "kC+block": (k + BLOCK, None),
        "extend": (k + 40, k),  # the cached prompt, extended to end inside a chunk
    }[length]


def expected_hit(length: str, model: str = DENSE) -> int:
    """Tokens a full hit serves: the whole chunks of the prompt computed first.

    A prompt that ends exactly on a chunk boundary is a hit of the whole prompt: vLLM 0.32
    loads it all and recomputes the last token over its loaded KV (`scheduler.py`,
    `num_computed_tokens == num_tokens` -> `num_tokens - 1`).

    Not on a model with sliding-window layers: there vLLM's offloading scheduler keeps the
    last prompt token out of the hit (`_lookup_complete_chunks`: "the last prompt token has
    to be recomputed to get the logprobs for sliding window attention", `max_hit_size_tokens
    -= 1`), and stores a window group's chunks only where such a hit can end
    (`_build_store_jobs`, `reachable_block_mask`), so a prompt computed to exactly a chunk
    boundary serves one chunk less, and so does its extension. vLLM's own CPU offloading
    caches the same (28 November 2026, `scripts/exactness_swa_probe.py`: 128 tokens of a
    192-token prompt and of its 232-token extension, 192 of 193 and 224, for both)."""
    served, computed = prompt_tokens(length)
    return expected_hit_tokens(computed or served, served, model)


def expected_hit_tokens(computed: int, served: int, model: str = DENSE) -> int:
    """`expected_hit` for a prompt of `served` tokens whose first `computed` were computed."""
    cached_prompt = min(served, computed)
    if model == SLIDING:
        return max(0, cached_prompt - 1) // CHUNK * CHUNK
    return cached_prompt // CHUNK * CHUNK


# Why a value pair never runs; cells with one are not applicable (and not counted).
EXCLUSIONS: dict[tuple[tuple[str, str], tuple[str, str]], str] = {}


def exclude(first: tuple[str, str], second: tuple[str, str], why: str) -> None:
    EXCLUSIONS[(first, second)] = why


def applicable(cell: Cell, models: Iterable[str], tps: Iterable[str]) -> bool:
    if cell.model not in models or cell.tp not in tps:
        return False
    values = {"model": cell.model, "tp": cell.tp, "tier": cell.tier, "length": cell.length, "feature": cell.feature}
    for (axis_a, value_a), (axis_b, value_b) in EXCLUSIONS:
        if values[axis_a] == value_a and values[axis_b] == value_b:
            return False
    return True


def all_cells(models: Iterable[str], tps: Iterable[str]) -> list[Cell]:
    models, tps = list(models), list(tps)
    return [
        cell
        for values in itertools.product(*AXES.values())
        if applicable(cell := Cell(*values), models, tps)
    ]


def pairs_of(cell: Cell) -> set[tuple[int, str, int, str]]:
    values = [cell.model, cell.tp, cell.tier, cell.length, cell.feature]
    return {(i, values[i], j, values[j]) for i, j in itertools.combinations(range(len(values)), 2)}


def covering(cells: list[Cell], seed: int, candidates: int = 60, engine_cost: float = 4.0) -> list[Cell]:
    """A greedy covering design (AETG-like): cells chosen until every pair some applicable
    cell has is covered. Each step draws `candidates` cells at random (seeded), adds the
    cells of engines already chosen and some cells holding the first uncovered pair, and
    takes the one covering most new pairs, less `engine_cost` if it needs a new engine.
    Deterministic for a seed."""
    rng = random.Random(seed)
    pairs = [frozenset(pairs_of(cell)) for cell in cells]
    holders: dict[tuple, list[int]] = {}
    for n, cell_pairs in enumerate(pairs):
        for pair in cell_pairs:
            holders.setdefault(pair, []).append(n)
    by_engine: dict[tuple[str, int, str], list[int]] = {}
    for n, cell in enumerate(cells):
        by_engine.setdefault(cell.engine(), []).append(n)
    uncovered = set(holders)
    chosen: list[int] = []
    engines: set[tuple[str, int, str]] = set()
    while uncovered:
        pool = set(rng.sample(range(len(cells)), min(candidates, len(cells))))
        for engine in engines:
            pool.update(by_engine[engine])
        target = min(uncovered)  # a cell holding it is always a candidate: every step progresses
        pool.update(rng.sample(holders[target], min(candidates, len(holders[target]))))

        def score(n: int) -> tuple[float, int]:
            return len(pairs[n] & uncovered) - (0 if cells[n].engine() in engines else engine_cost), -n

        best = max((n for n in sorted(pool) if pairs[n] & uncovered), key=score)
        chosen.append(best)
        engines.add(cells[best].engine())
        uncovered -= pairs[best]
    return [cells[n] for n in chosen]


def uncovered_pairs(design: list[Cell], cells: list[Cell]) -> set[tuple[int, str, int, str]]:
    wanted = set().union(*(pairs_of(cell) for cell in cells)) if cells else set()
    return wanted - set().union(*(pairs_of(cell) for cell in design)) if design else wanted


def values_of(cell: Cell) -> list[str]:
    return [cell.model, cell.tp, cell.tier, cell.length, cell.feature]
