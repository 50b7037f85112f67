"""What the end-to-end tests expect of an engine whose prompts kvstrata served."""

from __future__ import annotations

BLOCK = 32  # the test engines' block size (kvstrata._dev.testing.make_llm)


def expected_hit(prompt_tokens: int) -> int:
    """Whole blocks before the last prompt token (which vLLM always recomputes)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


# Two vLLM engines can round the same computation one float32 ulp apart (about 5e-7 at
# these logprobs; measured 26 November 2026, docs/operations.md): a reference from another
# engine is held to this, which wrong KV bytes exceed by orders of magnitude.
CROSS_ENGINE_TOLERANCE = 1e-5


def assert_close_logprobs(reference: list[dict], result: list[dict], context: object = None) -> None:
    """The same tokens at each step, their logprobs within `CROSS_ENGINE_TOLERANCE`."""
    assert len(result) == len(reference), context
    for step, ref_step in zip(result, reference):
        assert step.keys() == ref_step.keys(), (context, step, ref_step)
        assert all(abs(step[t] - ref_step[t]) < CROSS_ENGINE_TOLERANCE for t in step), (context, step, ref_step)


def assert_served_by_kvstrata(reference: list[dict], results: list[dict], same_engine: bool = True) -> None:
    """Every prompt found its whole prefix in kvstrata and produced the reference's tokens
    and logprobs: bit for bit when `reference` came from the same engine, within
    `CROSS_ENGINE_TOLERANCE` when from another one.

    Vacuous input fails: no results, fewer results than prompts, a reference without
    tokens, or prompts none of which has a whole block to find."""
    assert reference, "no reference results: nothing was compared"
    assert len(results) == len(reference), f"{len(results)} results for {len(reference)} prompts"
    assert any(expected_hit(result["prompt_tokens"]) > 0 for result in results), "no prompt spans a whole block"
    for ref, result in zip(reference, results):
        assert ref["token_ids"], "a reference produced no tokens"
        assert result["cached_tokens"] == expected_hit(result["prompt_tokens"])
        assert result["token_ids"] == ref["token_ids"]
        if same_engine:
            assert result["logprobs"] == ref["logprobs"]
        else:
            assert_close_logprobs(ref["logprobs"], result["logprobs"])
