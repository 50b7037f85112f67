"""The end-to-end expectation helper fails on what would make it vacuous (issue #29: it
passed on empty results), and on a prefix that was not served or an output that differs."""

from __future__ import annotations

import pytest

from tests.e2e.expect import BLOCK, assert_served_by_kvstrata


def result(prompt_tokens: int = 3 * BLOCK + 5, cached: int = 3 * BLOCK, tokens=(1, 2, 3), logprobs=(-0.5, -0.25, -1.0)):
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached, "token_ids": list(tokens), "logprobs": list(logprobs)}


def test_a_served_round_passes():
    assert_served_by_kvstrata([result(cached=0), result(cached=0)], [result(), result()])


@pytest.mark.parametrize(
    "reference, results",
    [
        ([], []),  # nothing compared
        ([result(cached=0)], []),  # the round produced nothing
        ([result(cached=0), result(cached=0)], [result()]),  # a prompt's result is missing
        ([result(cached=0, tokens=())], [result(tokens=())]),  # no tokens to compare
        ([result(prompt_tokens=5, cached=0)], [result(prompt_tokens=5, cached=0)]),  # no whole block to find
        ([result(cached=0)], [result(cached=BLOCK)]),  # only part of the prefix came from kvstrata
        ([result(cached=0)], [result(tokens=(1, 2, 4))]),  # another output
        ([result(cached=0)], [result(logprobs=(-0.5, -0.25, -1.5))]),  # other logprobs
    ],
)
def test_anything_short_of_served_fails(reference, results):
    with pytest.raises(AssertionError):
        assert_served_by_kvstrata(reference, results)
