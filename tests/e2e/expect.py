"""What the end-to-end tests expect of an engine whose prompts kvstrata served."""

from __future__ import annotations

BLOCK = 32  # the test engines' block size (kvstrata.testing.make_llm)


def expected_hit(prompt_tokens: int) -> int:
    """Whole blocks before the last prompt token (which vLLM always recomputes)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def assert_served_by_kvstrata(reference: list[dict], results: list[dict]) -> None:
    """Every prompt found its whole prefix in kvstrata and produced the reference's tokens
    and logprobs, bit for bit.

    Vacuous input fails: no results, fewer results than prompts, a reference without
    tokens, or prompts none of which has a whole block to find."""
    assert reference, "no reference results: nothing was compared"
    assert len(results) == len(reference), f"{len(results)} results for {len(reference)} prompts"
    assert any(expected_hit(result["prompt_tokens"]) > 0 for result in results), "no prompt spans a whole block"
    for ref, result in zip(reference, results):
        assert ref["token_ids"], "a reference produced no tokens"
        assert result["cached_tokens"] == expected_hit(result["prompt_tokens"])
        assert result["token_ids"] == ref["token_ids"]
        assert result["logprobs"] == ref["logprobs"]
