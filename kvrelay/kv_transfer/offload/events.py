"""The offload tiers' KV events: which prompt blocks each local tier (cpu, disk) holds.

The worker side's store logs what its local tiers store and drop, by tier key (store.py); the
scheduler side asks for that log over the lookup channel (["events"]) and turns it into KV
events in block hashes, medium = the tier's name in capitals ("CPU", "DISK"). It knows which
blocks a chunk holds because it handed out the chunk's store.

Published: the full chunks this instance stored since it started (a prompt's tail serves only
that very prompt, so its blocks are not a prefix others can find), each once every
tensor-parallel rank holds its shard in that tier, removed when any rank drops its shard.
Remote tiers (Redis, Mooncake Store) publish nothing: they are shared, and expire on their own.
"""

from __future__ import annotations

from collections import OrderedDict

from kvrelay.kv_events.events import BlockRemoved, BlockStored, KVEvent
from kvrelay.kv_transfer.offload.lookup import LookupClient
from kvrelay.kv_transfer.offload.store import shard_key

MAX_CHUNKS = 1 << 16  # chunk -> blocks entries kept (the oldest go first)


class TierEvents:
    def __init__(self, clients: list[LookupClient], shards: list[str], block_size: int) -> None:
        self.clients = clients
        self.shards = shards  # rank r's store keys its shard of a chunk with shards[r]
        self.block_size = block_size
        self._chunks: OrderedDict[str, tuple[bytes | None, list[bytes]]] = OrderedDict()
        self._chunk_of: dict[str, str] = {}  # tier key (any rank) -> chunk key
        self._holders: dict[tuple[str, str], set[int]] = {}  # (tier, chunk) -> ranks holding it

    def saved(self, chunk_key: str, parent_hash: bytes | None, block_hashes: list[bytes]) -> None:
        """A store of the chunk `chunk_key`, holding these blocks, was handed out."""
        self._chunks[chunk_key] = (parent_hash, block_hashes)
        self._chunks.move_to_end(chunk_key)
        for shard in self.shards:
            self._chunk_of[shard_key(chunk_key, shard)] = chunk_key
        while len(self._chunks) > MAX_CHUNKS:
            old, _ = self._chunks.popitem(last=False)
            for shard in self.shards:
                self._chunk_of.pop(shard_key(old, shard), None)

    def take(self) -> list[KVEvent]:
        """Ask every rank's store what changed; the events, in order."""
        events: list[KVEvent] = []
        for rank, client in enumerate(self.clients):
            for tier, kind, tier_key in client.ask(["events"]) or []:
                chunk = self._chunk_of.get(tier_key)
                if chunk is not None and chunk in self._chunks:
                    events.extend(self._event(rank, tier, kind, chunk))
        return events

    def _event(self, rank: int, tier: str, kind: str, chunk: str) -> list[KVEvent]:
        parent, hashes = self._chunks[chunk]
        holders = self._holders.setdefault((tier, chunk), set())
        was_complete = len(holders) == len(self.shards)
        if kind == "stored":
            holders.add(rank)
        else:
            holders.clear()  # one rank's shard gone: the chunk cannot be loaded from this tier
            del self._holders[(tier, chunk)]
        if not was_complete and len(holders) == len(self.shards):
            return [BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[],
                                block_size=self.block_size, lora_id=None, medium=tier.upper(),
                                lora_name=None)]
        if was_complete and kind == "removed":
            return [BlockRemoved(block_hashes=list(hashes), medium=tier.upper())]
        return []
