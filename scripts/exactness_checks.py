"""What a cell of the exactness matrix compares: a request's outcome (tokens, sampled and
prompt logprobs, cached tokens) against the reference engine's, the same engine's cold pass
and vLLM's own prefix-cache hit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import exactness_design as design
from exactness_models import FP8

TOLERANCE = 1e-5  # two engines may round one float32 ulp apart (tests/e2e/expect.py)


@dataclass
class Outcome:
    tokens: list[int]
    logprobs: list[dict[int, float]]
    prompt_logprobs: list[dict[int, float] | None]
    cached: int

    @classmethod
    def of(cls, output: Any) -> "Outcome":
        completion = output.outputs[0]
        return cls(
            list(completion.token_ids),
            [{t: e.logprob for t, e in step.items()} for step in (completion.logprobs or [])],
            [None if step is None else {t: e.logprob for t, e in step.items()} for step in (output.prompt_logprobs or [])],
            output.num_cached_tokens or 0,
        )


def max_gap(reference: list[dict | None], result: list[dict | None]) -> float | None:
    """Largest logprob difference over the steps both have (None: the token sets differ)."""
    gap = 0.0
    for ref, got in zip(reference, result):
        if ref is None or got is None:
            continue
        if ref.keys() != got.keys():
            return None
        gap = max(gap, max(abs(ref[t] - got[t]) for t in ref))
    return gap


def computed_positions(hit: Outcome, total: int) -> list[dict | None]:
    """The hit's prompt logprobs at the positions it computed. With a hit vLLM returns an
    entry for every position, but those up to the hit's end (the first computed token's
    logprob comes from the last cached position) are not computed: left out as None."""
    entries = list(hit.prompt_logprobs) + [None] * (total - len(hit.prompt_logprobs))
    return [None if position <= hit.cached else entry for position, entry in enumerate(entries[:total])]


def same_engine(cell: design.Cell, cold: Outcome, own: Outcome | None, hit: Outcome, served: list[int],
                computed_is_served: bool, bytes_exact: bool = False) -> tuple[str, bool]:
    """The hit against the same engine's cold pass of the same prompt: (what the cell line
    says, whether it is a failure). Bit for bit, or, where the cold pass rounds otherwise,
    bit for bit against vLLM's own prefix-cache hit of the same length (`own`).

    Why the second: the cold pass computed the tokens after the cached ones inside one
    prefill, the hit as a step of their own (a prompt ending on a chunk boundary: the last
    token over its loaded KV), and CPU kernels may round those one ulp apart. vLLM's own
    prefix-cache hit runs the hit's kernels over vLLM's own bytes of the cold pass. Where
    there is none of the same length (prefix caching off; a prompt ending on a chunk
    boundary, which vLLM's own cache serves a block short), a gap within TOLERANCE with
    the same tokens and every chunk's bytes back exactly as stored (`bytes_exact`) is that
    rounding too."""
    if not computed_is_served or cell.tp == "2>1" or cell.feature == "preempt":
        why = "the cold pass ran on the TP 2 engine" if cell.tp == "2>1" else "the cold pass computed a shorter prompt"
        return f"same-engine: n/a ({why})", False
    tail = computed_positions(hit, len(served))
    if equal(hit, cold, tail):
        return "same-engine: exact", False
    cold_gap = fmt(max_gap(cold.logprobs, hit.logprobs))
    if own is not None and own.cached == hit.cached:
        if equal(hit, own, tail):
            return f"same-engine: exact against vLLM's own cache hit (the cold pass {cold_gap} off)", False
        own_gap = fmt(max_gap(own.logprobs, hit.logprobs))
        return f"same-engine: NOT bit-exact against vLLM's own cache hit (gap {own_gap})", cell.model != FP8
    # No own-cache hit of the same length: prefix caching off, or a prompt ending on a
    # chunk boundary (kvstrata serves all of it and vLLM recomputes the last token over
    # its loaded KV; vLLM's own cache stops a block short).
    gap = max_gap(cold.logprobs, hit.logprobs)
    if bytes_exact and hit.tokens == cold.tokens and gap is not None and gap <= TOLERANCE:
        return f"same-engine: {cold_gap} off the cold pass, chunk bytes exact (no own-cache hit of this length)", False
    return f"same-engine: NOT bit-exact (gap {cold_gap}, the cold pass had {cold.cached} cached)", cell.model != FP8


def equal(hit: Outcome, other: Outcome, tail: list[dict | None]) -> bool:
    """Same tokens, same sampled logprobs, same prompt logprobs where the hit computed them."""
    return (
        hit.tokens == other.tokens and hit.logprobs == other.logprobs
        and all(h is None or h == o for h, o in zip(tail, other.prompt_logprobs))
    )  # fmt: skip


def first_difference(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def fmt(gap: float | None) -> str:
    return "differs" if gap is None else f"{gap:.1e}"


def served_from(before: dict, after: dict) -> str:
    moved = {source: after.get(f"{source}_promotions", 0) - before.get(f"{source}_promotions", 0) for source in ("disk", "peer", "object")}
    return ", ".join(f"{n} promoted from {source}" for source, n in moved.items() if n)
