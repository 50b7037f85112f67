"""What the end-to-end tests expect of an engine whose prompts kvstrata served."""

from __future__ import annotations

BLOCK = 32  # the test engines' block size (kvstrata.testing.make_llm)


def expected_hit(prompt_tokens: int) -> int:
    """Whole blocks before the last prompt token (which vLLM always recomputes)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def assert_served_by_kvstrata(reference: list[dict], results: list[dict]) -> None:
    """Every prompt found its whole prefix in kvstrata and produced the reference's tokens
    and logprobs, bit for bit."""
    assert len(results) <= len(reference)
    for ref, result in zip(reference, results):
        assert result["cached_tokens"] == expected_hit(result["prompt_tokens"])
        assert result["token_ids"] == ref["token_ids"]
        assert result["logprobs"] == ref["logprobs"]
