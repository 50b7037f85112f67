"""What the directory's answer means for each node: the contiguous prefix an engine there
would find, and which tier each of its chunks would come from. Keys and masks are
synthetic (the keys' names do not matter here, their order does)."""

from __future__ import annotations

from kvstrata.actors.directory import BUCKET_HOLDER, DirectoryShard, holder_label
from kvstrata.routing.coverage import ARENA, BUCKET, DISK, PEER, cluster_coverage
from kvstrata.routing.keys import KeyScheme, prompt_chunks
from kvstrata.routing.lookup import merge_answers, split_by_shard
from tests.utils import key

CHUNK = 128


def chunks(groups=(0,), anchors=None, prompt_tokens=1001):
    scheme = KeyScheme("ns", 32, tuple(CHUNK for _ in groups), tuple(groups), anchors, "sha256", 4096)
    hashes = [key(i)[:-4] for i in range(prompt_tokens // 32)]
    return prompt_chunks(scheme, hashes, prompt_tokens)


def mask(*bits: int) -> int:
    return sum(1 << b for b in bits)


def test_each_node_sees_its_own_tiers_other_nodes_and_the_bucket_in_promotion_order():
    prompt = chunks()  # 7 chunks of 128 tokens (896 loadable of 1001)
    masks = {
        holder_label("a", "CPU"): mask(0, 1, 2),
        holder_label("a", "STORAGE"): mask(2, 3),
        holder_label("b", "CPU"): mask(0, 1, 2, 3, 4),
        BUCKET_HOLDER: mask(0, 1, 2, 3, 4, 5),
    }
    seen = cluster_coverage(prompt, masks, ["a", "b", "c"])
    a, b, c = seen.of("a"), seen.of("b"), seen.of("c")
    assert (a.arena, a.disk, a.peer, a.servable) == (3 * CHUNK, 0, 5 * CHUNK, 6 * CHUNK)
    assert a.tokens_by_source == {ARENA: 3 * CHUNK, DISK: CHUNK, PEER: CHUNK, BUCKET: CHUNK}
    assert (b.arena, b.peer, b.servable) == (5 * CHUNK, 4 * CHUNK, 6 * CHUNK)
    assert b.tokens_by_source == {ARENA: 5 * CHUNK, BUCKET: CHUNK}
    assert c.tokens_by_source == {PEER: 5 * CHUNK, BUCKET: CHUNK} and c.arena == 0
    assert seen.bucket == 6 * CHUNK


def test_only_a_prefix_counts_and_never_the_prompt_s_last_token():
    prompt = chunks(prompt_tokens=3 * CHUNK)  # 3 chunks; the last one is recomputed anyway
    seen = cluster_coverage(prompt, {holder_label("a", "CPU"): mask(0, 1, 2)}, ["a"])
    assert seen.of("a").servable == 2 * CHUNK
    gap = cluster_coverage(chunks(), {holder_label("a", "CPU"): mask(0, 2, 3, 4)}, ["a"])
    assert gap.of("a").servable == CHUNK and gap.of("a").keys_by_source == {ARENA: 1}


def test_a_window_group_needs_only_its_chunk_at_the_hit_and_moves_the_hit_back_without_it():
    prompt = chunks(groups=(0, 1), anchors=(0,))  # keys 0-6: full attention; 7-13: the window group
    full = mask(*range(7))
    with_window = cluster_coverage(prompt, {holder_label("a", "CPU"): full | mask(7 + 6)}, ["a"])
    assert with_window.of("a").servable == 7 * CHUNK
    assert with_window.of("a").keys_by_source == {ARENA: 8}  # 7 full-attention chunks + 1 window chunk
    moved_back = cluster_coverage(prompt, {holder_label("a", "CPU"): full | mask(7 + 4)}, ["a"])
    assert moved_back.of("a").servable == 5 * CHUNK


def test_the_directory_answers_with_one_mask_per_holder_and_shards_merge_back_in_order():
    keys = [key(i) for i in range(40)]
    shards = [DirectoryShard(s) for s in range(3)]
    for shard in shards:
        mine = [k for k in keys if k[0] % 3 == shard.shard]
        shard.sync("a", {"ns": ([(k, "CPU", True) for k in mine[:4]] + [(k, "OBJECT", True) for k in mine], -1, False)})
    positions = split_by_shard(keys, 3)
    answers = {s: shards[s].coverage("ns", [keys[p] for p in where]) for s, where in positions.items()}
    merged = merge_answers(positions, answers)
    assert merged[BUCKET_HOLDER] == mask(*range(40))
    assert merged[holder_label("a", "CPU")] == mask(*(p for where in positions.values() for p in where[:4]))
    assert shards[0].coverage("other-namespace", keys) == {}


def test_what_was_just_routed_counts_as_on_that_node_until_it_expires():
    from kvstrata.keys import key_hash
    from kvstrata.routing.coverage import RecentPrefixes
    from tests.utils import FakeClock

    clock = FakeClock()
    recent = RecentPrefixes(pending_seconds=10, recent_seconds=10, clock=clock, max_blocks=30)
    prompt = chunks()
    blocks = [key(i)[:-4] for i in range(1001 // 32)]  # the prompt's block hashes (chunks() names them so)
    recent.add("a", blocks[:13])  # 13 blocks: 3 whole chunks and one block more
    assert key_hash(prompt.keys[2]) == blocks[11]
    assert recent.masks(prompt.keys) == {holder_label("a", "CPU"): mask(0, 1, 2)}
    assert recent.prefix_blocks("a", blocks) == 13 and recent.prefix_blocks("b", blocks) == 0
    seen = cluster_coverage(prompt, recent.masks(prompt.keys), ["a", "b"])
    assert seen.of("a").arena == 3 * CHUNK and seen.of("b").peer == 3 * CHUNK
    clock.advance(5)
    recent.add("b", blocks[13:31])  # over max_blocks: a's oldest go first
    assert recent.prefix_blocks("a", blocks) == 0 and recent.masks(prompt.keys)[holder_label("a", "CPU")] == mask(0, 1, 2)
    clock.advance(6)  # a's entries are 11 s old
    assert set(recent.masks(prompt.keys)) == {holder_label("b", "CPU")}


def test_a_routed_prompt_counts_as_stored_briefly_and_as_computed_longer():
    from kvstrata.routing.coverage import RecentPrefixes
    from tests.utils import FakeClock

    clock = FakeClock()
    recent = RecentPrefixes(pending_seconds=5, recent_seconds=60, clock=clock)
    prompt = chunks()
    blocks = [key(i)[:-4] for i in range(1001 // 32)]
    recent.add("a", blocks)
    clock.advance(6)  # the directory has had time to hear of the chunks: its word stands now
    assert recent.masks(prompt.keys) == {} and recent.prefix_blocks("a", blocks) == len(blocks)
    clock.advance(55)
    assert recent.prefix_blocks("a", blocks) == 0
