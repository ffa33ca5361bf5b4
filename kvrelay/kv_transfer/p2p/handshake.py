"""The handshake both P2P connectors open a peer with, and who this rank is.

D sends a `HandshakeRequest` to each prefill rank it reads from (pull) or registers with (push);
P answers with a `HandshakeReply`: its engine, process, backend, transport agent, KV layout,
model fingerprint and transfer mode. D checks the reply against its own `LocalIdentity` before it
touches a byte. Messages are msgspec Structs: they cross machines as msgpack, never pickle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec

from kvrelay.kv_transfer.side_channel import SideChannelClient, SideChannelError, decode
from kvrelay.kv_transfer.transport.base import RegionLayout
from kvrelay.model.sharding import kv_heads_of_rank

if TYPE_CHECKING:
    from kvrelay.kv_transfer.base import KVCacheSpec
    from kvrelay.kv_transfer.config import KVTransferConfig
    from kvrelay.kv_transfer.p2p.settings import NixlConfig


class HandshakeRequest(msgspec.Struct, kw_only=True):
    engine_id: str  # the caller's, for the peer's log
    expected_engine_id: str  # the engine id the caller's params name ("" when they name none)


class HandshakeReply(msgspec.Struct, kw_only=True):
    engine_id: str
    instance_id: str  # random per process start: tells a restarted peer apart
    backend: str
    agent_metadata: bytes
    layer_names: list[str]
    num_blocks: int
    block_bytes: int
    base_addresses: list[int]
    device: str
    block_size: int
    fingerprint_digest: str
    fingerprint: dict[str, Any]
    lease_seconds: float
    tp_size: int = 1
    tp_rank: int = 0  # which of P's ranks answers on this port (kv_port + tp_rank)
    transfer_mode: str = "pull"  # "push": a NixlPushConnector, which serves no reads
    transfer_timeout_seconds: float = 0.0  # how long one of this instance's writes may take (push)

    def layout(self) -> RegionLayout:
        """The peer's KV region, as the transport addresses it."""
        return RegionLayout(layer_names=tuple(self.layer_names), num_blocks=self.num_blocks,
                            block_bytes=self.block_bytes, base_addresses=tuple(self.base_addresses),
                            device=self.device)


def handshake_reply(transfer_config: KVTransferConfig, settings: NixlConfig, kv_spec: KVCacheSpec,
                    layout: RegionLayout, agent_metadata: bytes, instance_id: str,
                    **mode: Any) -> HandshakeReply:
    """P's answer: this rank's engine, layout and model; `mode` sets the mode-specific fields
    (transfer_mode, lease_seconds, transfer_timeout_seconds)."""
    fields: dict[str, Any] = {"lease_seconds": settings.lease_seconds, **mode}
    return HandshakeReply(
        engine_id=transfer_config.engine_id, instance_id=instance_id, backend=settings.backend,
        agent_metadata=agent_metadata, layer_names=list(layout.layer_names), num_blocks=layout.num_blocks,
        block_bytes=layout.block_bytes, base_addresses=list(layout.base_addresses), device=layout.device,
        block_size=kv_spec.block_size, fingerprint_digest=kv_spec.fingerprint_digest(),
        fingerprint=dict(kv_spec.fingerprint), tp_size=kv_spec.tp_size, tp_rank=kv_spec.tp_rank, **fields)


@dataclass(frozen=True)
class LocalIdentity:
    """What a peer must match before D reads (or takes writes into) its KV."""

    engine_id: str
    backend: str
    block_size: int
    fingerprint_digest: str
    fingerprint: dict[str, Any]
    layout: RegionLayout
    tp_rank: int = 0
    tp_size: int = 1
    num_kv_heads: int = 1  # the model's (the layout holds this rank's share)

    @classmethod
    def of(cls, transfer_config: KVTransferConfig, settings: NixlConfig, kv_spec: KVCacheSpec,
           layout: RegionLayout) -> LocalIdentity:
        return cls(engine_id=transfer_config.engine_id, backend=settings.backend,
                   block_size=kv_spec.block_size,
                   fingerprint_digest=kv_spec.fingerprint_digest(), fingerprint=dict(kv_spec.fingerprint),
                   layout=layout, tp_rank=kv_spec.tp_rank, tp_size=kv_spec.tp_size,
                   num_kv_heads=model_kv_heads(kv_spec))

    @property
    def head_bytes(self) -> int:
        """One KV head's K (or V) in one block of one layer (a block is [2, H_shard, bs, D])."""
        num_local_heads = len(kv_heads_of_rank(self.num_kv_heads, self.tp_size, self.tp_rank))
        return self.layout.block_bytes // (2 * num_local_heads)


def model_kv_heads(kv_spec: KVCacheSpec) -> int:
    """The model's KV heads (kv_spec's are this rank's share); the compatibility fingerprint
    names them, an engine without one is unsharded or splits its heads evenly."""
    return int(kv_spec.fingerprint.get("num_kv_heads", kv_spec.num_kv_heads * kv_spec.tp_size))


PeerT = TypeVar("PeerT")


@dataclass(frozen=True)
class HandshakeAnswered(Generic[PeerT]):
    """What a peer thread posts to the engine thread: a P rank answered the handshake, or could
    not be reached. The pull and the push receive post it, each with its own kind of peer."""

    peer: PeerT
    reply: HandshakeReply | None
    error: str | None  # why there is no reply


def ask_handshake(client: SideChannelClient, peer: PeerT, engine_id: str, expected_engine_id: str,
                  timeout_s: float) -> HandshakeAnswered[PeerT]:
    """Send the handshake on a peer thread's client and wait for P's answer (or the reason
    there is none)."""
    request = HandshakeRequest(engine_id=engine_id, expected_engine_id=expected_engine_id)
    try:
        reply = client.call("handshake", request, timeout_s)
        return HandshakeAnswered(peer, decode(reply.body, HandshakeReply), None)
    except SideChannelError as e:
        return HandshakeAnswered(peer, None, f"handshake with {client.address} failed: {e}")
