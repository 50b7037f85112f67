"""The client load of the fault matrix and the soak: all requests of a round in flight at
once through vLLM's own engine, greedy, prompts that come back round after round.

Why `LLM.generate` with a batch rather than HTTP clients: the requests reach the same
scheduler, the same kvstrata manager and the same workers, concurrently, as a server's
would; on two cores an API server process per row would cost more than the row itself.
Each prompt is distinct within a round (so vLLM's own prefix cache cannot serve one
request from another's blocks), and every round after `reset_prefix_cache` gets its
cached tokens from kvstrata only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

BLOCK = 32  # the engines' block size (kvstrata._dev.testing.make_llm)
MAX_TOKENS = 48  # decode steps keep a round in flight long enough for a fault to land mid-round


def prompts(count: int, chunks: int = 10, seed: int = 0) -> list[str]:
    """`count` distinct prompts of about `chunks` blocks (the tiny model's tokenizer is one
    token per character), each from one of a few topics."""
    topics = ["arena", "disk", "bucket", "peer"]
    out = []
    for i in range(count):
        topic = topics[(i + seed) % len(topics)]
        body = f"Request {seed}-{i} about the {topic} tier, told again and again. "
        out.append((body * (chunks * BLOCK // len(body) + 1))[: chunks * BLOCK + 5])
    return out


def expected_hit(prompt_tokens: int) -> int:
    """Whole blocks before the last prompt token (which vLLM always recomputes)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


@dataclass
class Round:
    """One round of requests: what came back, and how long it took."""

    sent: int
    completed: int = 0
    failed: int = 0
    error: str = ""
    token_ids: list[list[int]] = field(default_factory=list)
    cached_tokens: int = 0
    cached_per_request: list[int] = field(default_factory=list)
    expected_hit_tokens: int = 0
    seconds: float = 0.0

    @property
    def hit_fraction(self) -> float:
        return self.cached_tokens / self.expected_hit_tokens if self.expected_hit_tokens else 0.0


def run_round(llm, batch: list[str], reset: bool = True) -> Round:
    """Send every prompt of `batch` at once; a failure of the call fails every request in it."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    result = Round(sent=len(batch))
    started = time.monotonic()
    try:
        if reset:
            llm.reset_prefix_cache()
        outputs = llm.generate(batch, params, use_tqdm=False)
    except Exception as error:  # noqa: BLE001 - the matrix records it as failed requests
        result.failed, result.error = len(batch), f"{type(error).__name__}: {error}"[:200]
        result.seconds = time.monotonic() - started
        return result
    result.seconds = time.monotonic() - started
    for output in outputs:
        completion = output.outputs[0]
        if completion.finish_reason in ("length", "stop"):
            result.completed += 1
        else:
            result.failed += 1
        result.token_ids.append(list(completion.token_ids))
        result.cached_tokens += output.num_cached_tokens or 0
        result.cached_per_request.append(output.num_cached_tokens or 0)
        result.expected_hit_tokens += expected_hit(len(output.prompt_token_ids))
    return result


def run_batches(llm, batches: list[list[str]]) -> Round:
    """`run_round` for each batch in turn (prefix cache reset before each), as one Round
    whose requests are in the order of the concatenated batches. A failed batch does not
    stop the ones after it."""
    merged = Round(sent=0)
    for batch in batches:
        part = run_round(llm, batch)
        merged.sent += part.sent
        merged.completed += part.completed
        merged.failed += part.failed
        merged.error = merged.error or part.error
        # A failed batch returns no tokens: keep the positions aligned with the prompts.
        merged.token_ids += part.token_ids or [[] for _ in batch]
        merged.cached_per_request += part.cached_per_request or [0 for _ in batch]
        merged.cached_tokens += part.cached_tokens
        merged.expected_hit_tokens += part.expected_hit_tokens
        merged.seconds += part.seconds
    return merged


def changed_outputs(reference: list[list[int]], got: Round) -> list[int]:
    """The requests (indices into the batch) that produced other tokens than the fault-free
    reference (a failed batch's requests, which produced none, are counted as failed)."""
    return [i for i, (ref, tokens) in enumerate(zip(reference, got.token_ids)) if tokens and ref != tokens]
