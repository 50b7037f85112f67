"""Prefix-chain admission on crafted chains: the head of every prefix and whatever was used
again are written down; a tail used once is not; a position never heard is admitted."""

from __future__ import annotations

import numpy as np
import pytest

from kvstrata.tiers.chain_admission import ChainAdmission
from kvstrata.tiers.frequency import SCALAR_KEYS, FrequencySketch, keys_to_u64
from tests.utils import key


def chain(start: int, blocks: int, tokens: int = 512) -> list[tuple[bytes, int]]:
    """A request's chunks and the token each one's prefix ends at."""
    return [(key(start + i), (i + 1) * tokens) for i in range(blocks)]


def test_the_head_of_a_chain_is_admitted_and_its_tail_is_not():
    policy = ChainAdmission(head_tokens=4 * 512)
    request = chain(0, 10)
    policy.note_positions(request)
    keys = [k for k, _ in request]
    assert policy.admit(keys, [False] * 10) == [True] * 4 + [False] * 6


def test_a_tail_chunk_used_again_is_admitted():
    policy = ChainAdmission(head_tokens=1024)
    request = chain(0, 6)
    policy.note_positions(request)
    keys = [k for k, _ in request]
    reused = [False, False, False, True, True, False]  # the next turn read 4 and 5 back
    assert policy.admit(keys, reused) == [True, True, False, True, True, False]


def test_a_shared_prefix_keeps_its_earliest_position():
    """A chain that grew from another: the shared chunks end at the same tokens in both."""
    policy = ChainAdmission(head_tokens=2 * 512)
    first = chain(0, 3)
    grown = first + [(key(100), 4 * 512), (key(101), 5 * 512)]
    policy.note_positions(first)
    policy.note_positions(grown)
    assert [policy.in_head(k) for k, _ in grown] == [True, True, False, False, False]
    policy.note_positions([(key(2), 512)])  # an engine that says otherwise: the smaller wins
    assert policy.position(key(2)) == 512


def test_a_chunk_whose_position_is_unknown_is_admitted():
    """An older vLLM (no key positions) or a tool: the policy never skips what it cannot place."""
    policy = ChainAdmission(head_tokens=0)
    assert policy.admit([key(7)], [False]) == [True]


def test_positions_are_bounded_oldest_forgotten_first():
    policy = ChainAdmission(head_tokens=512, remembered=4)
    policy.note_positions(chain(0, 6))
    assert len(policy) == 4
    assert policy.position(key(0)) is None and policy.position(key(5)) == 6 * 512


@pytest.mark.parametrize("head, remembered", [(-1, 1), (0, 0)])
def test_bad_settings_are_named(head, remembered):
    with pytest.raises(ValueError, match="head_tokens|remembered"):
        ChainAdmission(head, remembered)


def test_the_sketch_counts_a_few_keys_as_it_counts_many():
    """The plain-Python path for a handful of keys (the write-back path's) agrees with numpy's."""
    sketch = FrequencySketch(window=4096)
    hashed = keys_to_u64([key(i % 50) for i in range(300)])
    sketch.add_many(hashed)
    probe = keys_to_u64([key(i) for i in range(60)])
    together = sketch.counts(probe)  # more than SCALAR_KEYS: numpy
    assert len(probe) > SCALAR_KEYS
    one_by_one = np.concatenate([sketch.counts(probe[i : i + 1]) for i in range(len(probe))])
    assert one_by_one.dtype == together.dtype == np.uint8
    assert one_by_one.tolist() == together.tolist()
    assert together[:50].min() >= 6 and together[50:].max() <= together[:50].min()
