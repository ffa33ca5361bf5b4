"""The KV index over vLLM instances, without vLLM: events in vLLM's shape (integer hashes by
default), a scheme confirmed or corrected by the events, an instance whose hashes cannot be
reproduced routed by load and reported, and a mixed pool of kvrelay and vLLM instances."""

from __future__ import annotations

from kvrelay.core.block_hash import hash_token_blocks
from kvrelay.disagg.backends import Backend
from kvrelay.disagg.routing import KVIndex, PromptBlocks, create_policy
from kvrelay.disagg.routing.hash_schemes import KVRELAY_SCHEME, VllmScheme, external, vllm_candidates
from kvrelay.kv_events import AllBlocksCleared, BlockStored, KVEventBatch

BLOCK = 16
PROMPT = list(range(1000, 1000 + 5 * BLOCK + 3))  # five full blocks and a partial one


def stored(hashes: list[bytes], tokens: list[int], as_int: bool = True,
           salt: str | None = None) -> KVEventBatch:
    """A vLLM BlockStored event: its untagged extra keys name the salt of a salted first block."""
    published = [external(h, as_int) for h in hashes]
    extra_keys = [(salt,) if salt and i == 0 else None for i in range(len(hashes))]
    return KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=published, parent_block_hash=None, token_ids=tokens[:len(hashes) * BLOCK],
        block_size=BLOCK, lora_id=None, medium="GPU", lora_name=None, extra_keys=extra_keys,
        group_idx=0, kv_cache_spec_kind="full_attention")])


def vllm_index(url: str, uses: VllmScheme, tokens: list[int], algo: str | None = None,
               seed: str | None = None, as_int: bool = True) -> KVIndex:
    """An index following one vLLM instance that hashes with `uses` and stored `tokens`; the
    proxy was told `algo` and `seed` (None: find out)."""
    index = KVIndex()
    index.track(url, subscribed=True, schemes=vllm_candidates(algo, seed))
    index.on_batch(url, 0, stored(uses.chain(tokens, BLOCK), tokens, as_int))
    return index


def test_a_vllm_instances_integer_hashes_predict_its_prefix_hit() -> None:
    index = vllm_index("http://v", VllmScheme("sha256"), PROMPT[:3 * BLOCK])
    status = index.status("http://v")
    assert (status.usable, status.scheme, status.hashes, status.blocks) == (True, "vllm sha256", "verified",
                                                                             {"GPU": 3})
    assert index.prefix_hit_tokens("http://v", PromptBlocks(PROMPT)) == 3 * BLOCK
    assert index.prefix_hit_tokens("http://v", PromptBlocks([7] + PROMPT[1:])) == 0


def test_full_digests_are_matched_as_well() -> None:
    index = vllm_index("http://v", VllmScheme("sha256"), PROMPT[:2 * BLOCK], as_int=False)
    assert index.prefix_hit_tokens("http://v", PromptBlocks(PROMPT)) == 2 * BLOCK


def test_the_events_pick_the_algorithm_the_instance_really_uses() -> None:
    index = vllm_index("http://v", VllmScheme("sha256_cbor"), PROMPT[:2 * BLOCK])
    status = index.status("http://v")
    assert (status.scheme, status.hashes) == ("vllm sha256_cbor", "verified")
    assert index.prefix_hit_tokens("http://v", PromptBlocks(PROMPT)) == 2 * BLOCK


def test_a_seed_the_proxy_was_given_is_used_and_one_it_was_not_is_reported() -> None:
    seeded = VllmScheme("xxhash", "99")
    index = vllm_index("http://v", seeded, PROMPT[:2 * BLOCK], seed="99")
    assert (index.status("http://v").scheme, index.prefix_hit_tokens("http://v", PromptBlocks(PROMPT))) == (
        "vllm xxhash", 2 * BLOCK)
    index = vllm_index("http://v", VllmScheme("sha256", "99"), PROMPT[:2 * BLOCK])  # not told the seed
    status = index.status("http://v")
    assert (status.usable, status.hashes) == (False, "not reproducible")
    assert status.reason.startswith("hashes not reproducible")
    assert index.prefix_hit_tokens("http://v", PromptBlocks(PROMPT)) is None


def test_an_instance_whose_hashes_cannot_be_reproduced_is_routed_by_load() -> None:
    index = vllm_index("http://a", VllmScheme("sha256", "99"), PROMPT[:3 * BLOCK])
    index.track("http://b", subscribed=True, schemes=vllm_candidates(None, None))
    index.on_batch("http://b", 0, KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    a, b = Backend("http://a", "prefill"), Backend("http://b", "prefill")
    decision = create_policy("kv-aware", "prefill", index).choose([a, b], PromptBlocks(PROMPT))
    assert decision.reason == "index_unavailable"  # b has heard no store yet; a's do not verify


def test_a_restart_forgets_the_verified_scheme_and_checks_again() -> None:
    index = vllm_index("http://v", VllmScheme("sha256"), PROMPT[:2 * BLOCK])
    index.on_reset("http://v", "restarted")
    assert index.status("http://v").hashes == "assumed" and index.status("http://v").blocks == {}
    cbor_prompt = PROMPT[BLOCK:4 * BLOCK]
    index.on_batch("http://v", 0, stored(VllmScheme("sha256_cbor").chain(cbor_prompt, BLOCK), cbor_prompt))
    assert index.status("http://v").scheme == "vllm sha256_cbor"


def test_a_mixed_pool_predicts_each_instance_in_its_own_hash() -> None:
    index = vllm_index("http://vllm", VllmScheme("sha256"), PROMPT[:2 * BLOCK])
    index.track("http://kvrelay", subscribed=True, schemes=(KVRELAY_SCHEME,))
    tokens = PROMPT[:4 * BLOCK]
    index.on_batch("http://kvrelay", 0, stored(hash_token_blocks(tokens, BLOCK), tokens, as_int=False))
    prompt = PromptBlocks(PROMPT)
    assert index.prefix_hit_tokens("http://vllm", prompt) == 2 * BLOCK
    assert index.prefix_hit_tokens("http://kvrelay", prompt) == 4 * BLOCK
    backends = [Backend("http://vllm", "prefill"), Backend("http://kvrelay", "prefill")]
    decision = create_policy("kv-aware", "prefill", index).choose(backends, prompt)
    assert (decision.backend.url, decision.reason, decision.predicted_hit_tokens) == (
        "http://kvrelay", "prefix_hit", 4 * BLOCK)


def test_a_salted_prompt_matches_only_blocks_stored_with_that_salt() -> None:
    sha = VllmScheme("sha256")
    index = vllm_index("http://v", sha, PROMPT[:2 * BLOCK])
    salted = PromptBlocks(PROMPT, cache_salt="tenant-7")
    assert index.prefix_hit_tokens("http://v", salted) == 0
    index.on_batch("http://v", 1, stored(sha.chain(PROMPT[:3 * BLOCK], BLOCK, cache_salt="tenant-7"),
                                         PROMPT[:3 * BLOCK], salt="tenant-7"))
    assert index.prefix_hit_tokens("http://v", salted) == 3 * BLOCK
    assert index.status("http://v").usable  # a salted store cannot check the scheme: no verdict
