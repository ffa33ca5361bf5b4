"""Secrets, keys, signed kv_transfer_params and KV block checksums for the pull connector.

One shared secret per cluster (`KVRELAY_KV_SECRET`, or the file named by `secret_file`) yields
two keys: one authenticates every side-channel message, the other signs the kv_transfer_params
a prefill instance hands out. Without a secret both keys are derived from the empty string, so
they are public: messages and params are then protected against accidents (a stale or mangled
params, a peer from another cluster version), not against forgery. That mode is therefore
restricted to loopback: the side channel binds to and talks to loopback addresses only.

Whatever the mode, a params cannot make a decode instance read another request's KV: the
prefill instance checks every read against its own lease (a random lease id, the block ids it
issued and a digest of the prompt tokens) before it lets it happen.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from kvrelay import env
from kvrelay.utils import cdiv

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

MIN_SECRET_CHARS = 16
PARAMS_VERSION = 1
# The params fields (besides the signature) that the signature covers, in signing order.
SIGNED_PARAM_FIELDS = ("remote_request_id", "remote_engine_id", "remote_lease_id", "remote_block_ids",
                       "remote_num_tokens", "remote_block_size", "remote_lease_expiry_ms",
                       "remote_host", "remote_port")


# The params field naming the secret P signed with (Keys.key_id), beside the signature. Not signed
# itself: it only lets D tell "P holds another secret" from "forged or altered" in its message.
KEY_ID_FIELD = "signature_key_id"


@dataclass(frozen=True)
class Keys:
    channel: bytes  # HMAC-SHA256 key of every side-channel message
    params: bytes  # HMAC-SHA256 key of kv_transfer_params
    authenticated: bool  # False: no secret was configured; the keys are public
    transport: bytes | None = None  # the transport's own authentication secret (None: none)
    # Names the secret without revealing it: 16 hex digits of HMAC(secret, a fixed label), one
    # more key derived like the others, so it helps neither forging nor guessing ("" without a
    # secret). Two instances with the same secret have the same key id.
    key_id: str = ""


def load_keys(secret_file: str | None) -> Keys:
    """Keys from `secret_file` (wins) or KVRELAY_KV_SECRET; public keys when neither is set."""
    secret = _read_secret_file(secret_file) if secret_file is not None else env.kv_secret()
    if secret is not None and len(secret) < MIN_SECRET_CHARS:
        source = secret_file or "KVRELAY_KV_SECRET"
        raise ValueError(f"the KV transfer secret from {source} has {len(secret)} characters; use at "
                         f"least {MIN_SECRET_CHARS} (e.g. `python -c 'import secrets; "
                         "print(secrets.token_hex(32))'`)")
    raw = (secret or "").encode()
    return Keys(channel=_derive(raw, b"kvrelay side channel v1"),
                params=_derive(raw, b"kvrelay kv_transfer_params v1"),
                authenticated=secret is not None,
                transport=_derive(raw, b"kvrelay transport v1") if secret is not None else None,
                key_id=_derive(raw, b"kvrelay key id v1").hex()[:16] if secret is not None else "")


def _read_secret_file(path: str) -> str:
    try:
        secret = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"cannot read the KV transfer secret_file {path!r}: {e.strerror}") from None
    if not secret:
        raise ValueError(f"the KV transfer secret_file {path!r} is empty")
    return secret


def _derive(secret: bytes, label: bytes) -> bytes:
    return hmac.new(secret, label, hashlib.sha256).digest()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_kv_ip(kv_ip: str, keys: Keys, warn: bool = True) -> None:
    """A side channel reachable from other machines must be authenticated."""
    if keys.authenticated:
        if warn:
            logger.info("KV transfer secret: key id %s (every instance of the cluster must show the same)",
                        keys.key_id)
        return
    if not is_loopback(kv_ip):
        raise ValueError(
            f"kv_ip={kv_ip!r} is reachable from other machines, but no KV transfer secret is set: "
            "set KVRELAY_KV_SECRET (or kv_connector_extra_config.secret_file) on every instance "
            "of the cluster, or use kv_ip='127.0.0.1'")
    if warn:
        logger.warning("no KV transfer secret (KVRELAY_KV_SECRET / secret_file) is set: the KV side "
                       "channel is unauthenticated and restricted to loopback (%s)", kv_ip)


def advertised_host(kv_ip: str) -> str:
    """The address peers should dial: kv_ip, unless it is a wildcard bind address."""
    if kv_ip in ("0.0.0.0", "::", ""):
        return socket.gethostbyname(socket.gethostname())
    return kv_ip


# ---------------------------------------------------------------- kv_transfer_params


def prompt_digest(token_ids: Sequence[int]) -> bytes:
    """Binds a lease and a params to the prompt whose KV they carry (never sent in the params)."""
    return hashlib.blake2b(msgspec.msgpack.encode(list(token_ids)), digest_size=16).digest()


def _params_message(params: Mapping[str, Any], token_ids: Sequence[int]) -> bytes:
    fields = [params.get(name) for name in SIGNED_PARAM_FIELDS]
    return msgspec.msgpack.encode([PARAMS_VERSION, *fields, prompt_digest(token_ids)])


def sign_params(params: Mapping[str, Any], token_ids: Sequence[int], key: bytes) -> str:
    return hmac.new(key, _params_message(params, token_ids), hashlib.sha256).hexdigest()


def signed_params(params: Mapping[str, Any], token_ids: Sequence[int], keys: Keys) -> dict[str, Any]:
    """`params` with their signature and the id of the key that made it."""
    return {**params, "signature": sign_params(params, token_ids, keys.params), KEY_ID_FIELD: keys.key_id}


def check_params(params: Mapping[str, Any], token_ids: Sequence[int], block_size: int,
                 key: bytes, now: float | None = None, key_id: str | None = None) -> str | None:
    """Why a decode instance must not use these params, or None when they are sound.

    Checks the shape (every prompt block named once, same block size, the same prompt length),
    the signature (which also binds the prompt tokens) and the expiry. The peer's pool size is
    only known after the handshake and is checked then. `key_id`: this instance's (Keys.key_id);
    a bad signature under another key id is then reported as P and D holding different secrets.
    """
    signature = params.get("signature")
    if not isinstance(signature, str):
        return "the params are unsigned (no 'signature')"
    shape_error = _shape_error(params, len(token_ids), block_size)
    if shape_error is not None:
        return shape_error
    try:
        valid = hmac.compare_digest(signature, sign_params(params, token_ids, key))
    except (TypeError, ValueError, msgspec.EncodeError):
        valid = False
    if not valid:
        return _bad_signature(params.get(KEY_ID_FIELD), key_id)
    now = time.time() if now is None else now
    expiry_ms = params["remote_lease_expiry_ms"]
    if now * 1000 >= expiry_ms:
        return f"the params expired {now - expiry_ms / 1000:.1f} s ago"
    return None


def _bad_signature(theirs: Any, ours: str | None) -> str:
    if isinstance(theirs, str) and ours is not None and theirs != ours:
        def name(key_id: str) -> str:
            return f"key id {key_id}" if key_id else "no secret"

        return (f"the params signature is invalid: P signed with {name(theirs)}, this instance has "
                f"{name(ours)}, so P and D most likely hold different KV transfer secrets; give every "
                "instance of the cluster the same KVRELAY_KV_SECRET (or secret_file)")
    return "the params signature is invalid (forged, altered, or another prompt's params)"


def _shape_error(params: Mapping[str, Any], num_prompt_tokens: int, block_size: int) -> str | None:
    num_tokens = params.get("remote_num_tokens")
    block_ids = params.get("remote_block_ids")
    if num_tokens != num_prompt_tokens:
        return f"the params carry {num_tokens} tokens, the prompt has {num_prompt_tokens}"
    if params.get("remote_block_size") != block_size:
        return f"the peer's block size is {params.get('remote_block_size')}, ours is {block_size}"
    num_blocks = cdiv(num_prompt_tokens, block_size)
    if not isinstance(block_ids, list) or len(block_ids) != num_blocks:
        return (f"the params name {len(block_ids or [])} blocks for {num_prompt_tokens} tokens "
                f"(need {num_blocks})")
    if len(set(block_ids)) != len(block_ids) or not all(
            isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
        return f"the params' remote_block_ids are not distinct block ids: {block_ids}"
    for name in ("remote_request_id", "remote_engine_id", "remote_lease_id", "remote_host"):
        if not isinstance(params.get(name), str) or not params.get(name):
            return f"the params lack {name}"
    if not all(isinstance(params.get(name), int) for name in ("remote_port", "remote_lease_expiry_ms")):
        return "the params lack remote_port or remote_lease_expiry_ms"
    return None


# ---------------------------------------------------------------- checksums

def _runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive block ids as [start, end) runs: each run is one contiguous slice of a layer."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][1] == b:
            runs[-1] = (runs[-1][0], b + 1)
        else:
            runs.append((b, b + 1))
    return runs


_FOLD = 1000003  # a block's digest is Horner's rule over its per-layer word sums


def block_digests(kv_layers: Sequence[torch.Tensor], block_ids: Sequence[int],
                  ranges: Sequence[tuple[int, int]] | None = None) -> list[int]:
    """One 64-bit checksum per block over every layer's bytes of it (K and V), or with `ranges`
    ((offset, length) within a block) over those bytes of it only: what a read of a KV-head
    slice moves, so P and D checksum the same bytes at their own offsets.

    The sum (mod 2**64) of the block's 64-bit words, read in place (a run of consecutive blocks is
    one slice of the layer, no gather copy): one pass over memory, about as fast as a copy, which
    a cryptographic hash is not (blake2b runs at ~0.5 GB/s here). Any corrupted word, a short
    or missing write, or the wrong block changes it; a permutation of words inside one block does
    not, which no transport failure produces. It detects corruption, not an adversary: integrity
    against an adversary comes from the authenticated side channel.

    Folded over layers as `digest = digest * 1000003 + layer_sum` (mod 2**64), which equals
    `sum(layer_sum[l] * 1000003**(L-1-l))`: each layer's share is independent of the others, so
    `DigestFold` can add them one layer at a time, in any order, to the same result.
    """
    import torch

    if not block_ids:
        return []
    total = torch.zeros(len(block_ids), dtype=torch.int64, device=kv_layers[0].device)
    for kv in kv_layers:
        total = total * _FOLD + _sums(kv, block_ids, ranges)  # [n]
    return [int(x) for x in total.tolist()]


def _gather_ranges(kv: torch.Tensor, block_ids: Sequence[int],
                   ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """[n, sum of lengths] uint8: the byte ranges of each block, concatenated in range order."""
    import torch

    raw = kv.reshape(kv.shape[0], -1).view(torch.uint8)  # [num_blocks, block_bytes]
    ids = torch.tensor(list(block_ids), device=kv.device)  # [n]
    return torch.cat([raw[ids, offset:offset + length] for offset, length in ranges], dim=1)  # [n, sum]


class DigestFold:
    """`block_digests` of a prompt's blocks (or of their `ranges` bytes), built one layer's share
    at a time.

    A sender folds each layer's blocks in as soon as they are final (all their tokens computed),
    so when the last layer is done only that layer's share is left, instead of a pass over every
    layer's bytes on the critical path. Blocks are positions in the prompt (0 = its first block);
    every layer folds a growing prefix of them. The result is bit-identical to `block_digests`.
    """

    def __init__(self, kv_layers: Sequence[torch.Tensor], num_blocks: int,
                 ranges: Sequence[tuple[int, int]] | None = None) -> None:
        import torch

        self.kv_layers = kv_layers
        self.num_blocks = num_blocks
        self.ranges = ranges  # (offset, length) of each block: only those bytes count
        self.folded = [0] * len(kv_layers)  # per layer: leading blocks already added
        self._weights = _layer_weights(len(kv_layers))
        self._totals = torch.zeros(num_blocks, dtype=torch.int64, device=kv_layers[0].device)  # [num_blocks]

    def fold(self, layer: int, block_ids: Sequence[int], upto: int) -> None:
        """Add `layer`'s share of prompt blocks [folded, upto); `block_ids` maps them to the pool."""
        start, upto = self.folded[layer], min(upto, self.num_blocks)
        if upto <= start:
            return
        sums = _sums(self.kv_layers[layer], block_ids[start:upto], self.ranges)  # [upto - start]
        self._totals[start:upto] += sums * self._weights[layer]
        self.folded[layer] = upto

    def digests(self, block_ids: Sequence[int], first: int = 0) -> list[int]:
        """Digests of prompt blocks [first, num_blocks), folding in whatever is still missing."""
        for layer in range(len(self.kv_layers)):
            self.fold(layer, block_ids, self.num_blocks)
        return [int(x) for x in self._totals[first:].tolist()]


class LandedSums:
    """`block_digests` of a receiver's blocks, from each layer's word sums taken as writes land.

    A receiver that sees every write land (the TCP push) records the sums of the bytes just
    written; a block written again (a chunk's partial last block) simply replaces its sums. At
    the completing write only the combination is left, not a pass over every layer's bytes.
    Writes may land on several threads at once.
    """

    def __init__(self, kv_layers: Sequence[torch.Tensor], block_ids: Sequence[int],
                 ranges: Sequence[tuple[int, int]] | None = None) -> None:
        import numpy as np

        self.kv_layers = kv_layers
        self.ranges = ranges  # (offset, length) of each block: only those bytes count
        self._position = {b: i for i, b in enumerate(block_ids)}
        # NOTE: numpy, not torch: written on transport threads, where a tensor made under the
        # engine's inference mode may not be updated in place
        self._sums = np.zeros((len(kv_layers), len(block_ids)), dtype=np.int64)  # [L, n]
        self._landed = np.zeros((len(kv_layers), len(block_ids)), dtype=bool)  # [L, n]
        self._lock = threading.Lock()

    def record(self, block_ids: Sequence[int], layers: Sequence[int]) -> None:
        """The bytes of `layers` x `block_ids` just landed (all of them are this receiver's)."""
        positions = [self._position[b] for b in block_ids]
        sums = [_sums(self.kv_layers[layer], block_ids, self.ranges).cpu().numpy()  # each [n]
                for layer in layers]
        with self._lock:
            for layer, layer_sums in zip(layers, sums, strict=True):
                self._sums[layer, positions] = layer_sums
                self._landed[layer, positions] = True

    def digests(self) -> list[int] | None:
        """The blocks' digests, or None when some layer of some block never landed."""
        import numpy as np

        with self._lock:
            if not bool(self._landed.all()):
                return None
            weights = np.array(_layer_weights(len(self.kv_layers)), dtype=np.int64)  # [L]
            total = (self._sums * weights[:, None]).sum(axis=0)  # [n], wrapping like block_digests
        return [int(x) for x in total.tolist()]


def _layer_weights(num_layers: int) -> list[int]:
    """Layer l's multiplier 1000003**(L-1-l) mod 2**64, as the signed int64 torch multiplies by."""
    weights, w = [], 1
    for _ in range(num_layers):
        weights.append(w - 2**64 if w >= 2**63 else w)
        w = w * _FOLD % 2**64
    return weights[::-1]


def _layer_sums(kv: torch.Tensor, block_ids: Sequence[int]) -> torch.Tensor:
    """[n] word sums of one layer's blocks, in block_ids order (each run of ids read in place)."""
    import torch

    sums = [_word_sums(kv[a:b]) for a, b in _runs(block_ids)]  # each [b - a]
    return sums[0] if len(sums) == 1 else torch.cat(sums)


def _sums(kv: torch.Tensor, block_ids: Sequence[int],
          ranges: Sequence[tuple[int, int]] | None) -> torch.Tensor:
    """[n] word sums of one layer's blocks, or of only their `ranges` bytes."""
    if ranges is None:
        return _layer_sums(kv, block_ids)
    return _word_sums(_gather_ranges(kv, block_ids, ranges))


def _word_sums(blocks: torch.Tensor) -> torch.Tensor:
    """[n, ...] contiguous blocks -> [n] int64 sums of their 64-bit words."""
    import torch

    raw = blocks.reshape(blocks.shape[0], -1).view(torch.uint8)  # [n, block_bytes]
    if raw.device.type == "cpu" and raw.shape[1] % 8 == 0:
        # NOTE: numpy sums on this thread. torch splits each of these small reductions across
        # its intra-op threads, and on a busy machine every one then waits for a descheduled
        # thread: 0.2 GB/s instead of ~25 (16-token blocks, 2 threads, 2 loaded cores).
        return torch.from_numpy(raw.numpy().view("i8").sum(axis=1))  # [n]
    words = raw.view(torch.int64) if raw.shape[1] % 8 == 0 else raw.to(torch.int64)
    return words.sum(dim=1)
