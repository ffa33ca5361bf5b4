"""The OffloadConnector's scheduler half: which chunks to load into which blocks, which to store.

Pure bookkeeping (no torch, no tensors): it asks the worker half what the store holds through
the lookup channel, and tells it through the per-step metadata what to load and save.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvrelay.core.block_hash import hash_token_blocks
from kvrelay.kv_transfer.offload.config import OffloadConfig
from kvrelay.kv_transfer.offload.lookup import LookupClient, ShardedLookupClient
from kvrelay.kv_transfer.offload.meta import (
    ChunkLoad,
    ChunkSave,
    LoadJob,
    OffloadConnectorMetadata,
    PromptKeys,
    prompt_keys,
)
from kvrelay.outputs import KVConnectorOutput
from kvrelay.utils import cdiv

if TYPE_CHECKING:
    from kvrelay.core.sched_output import SchedulerOutput
    from kvrelay.kv_events.events import KVEvent
    from kvrelay.kv_transfer.offload.events import TierEvents
    from kvrelay.request import Request


class PromptKeyer(Protocol):
    """How a prompt's entries are keyed in the store."""

    def request_keys(self, request: Request) -> PromptKeys:
        """The keys of a request's prompt (its chunks, then its tail)."""

    def token_keys(self, token_ids: list[int]) -> PromptKeys | None:
        """The keys of a prompt known only by its tokens (None: this keyer needs more)."""


class TokenKeyer:
    """kvrelay's own keys: a chained hash of the prompt's tokens, rooted in the fingerprint."""

    def __init__(self, chunk_tokens: int, fingerprint: str) -> None:
        self.chunk_tokens, self.fingerprint = chunk_tokens, fingerprint

    def request_keys(self, request: Request) -> PromptKeys:
        return prompt_keys(request.prompt_token_ids, self.chunk_tokens, self.fingerprint)

    def token_keys(self, token_ids: list[int]) -> PromptKeys | None:
        return prompt_keys(token_ids, self.chunk_tokens, self.fingerprint)


@dataclass
class _Lookup:
    """The latest admission answer for a request, consumed by after_alloc."""

    num_local: int
    num_stored_keys: int  # leading keys of PromptKeys.all that the store holds


@dataclass
class _Tracked:
    """A live request's prompt entries: their keys, its blocks, what is still to store."""

    keys: PromptKeys
    num_prompt_tokens: int
    block_ids: list[int]
    next_chunk: int
    tail_done: bool  # the tail is stored (or found stored), or there is none to store
    token_ids: list[int] = field(default_factory=list)  # the prompt, for the KV events' hashes
    hashes: list[bytes] | None = None  # its full blocks' chained hashes, once needed


class OffloadScheduler:
    def __init__(self, config: OffloadConfig, block_size: int, fingerprint: str,
                 client: LookupClient | ShardedLookupClient,
                 can_load: bool, can_save: bool, tier_events: TierEvents | None = None) -> None:
        self.config = config
        self.block_size = block_size
        self.blocks_per_chunk = config.chunk_tokens // block_size
        self.fingerprint = fingerprint
        self.client = client
        self.can_load, self.can_save = can_load, can_save
        self._lookups: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadJob] = []
        self._saves_unconfirmed = False  # saves handed out since the worker last had none pending
        self.tier_events = tier_events  # the tiers' KV events, when the engine publishes them
        self._events_due = False  # stores or loads handed out since the tiers' events were read
        # NOTE: replaceable once, right after construction (vLLM's adapter keys by vLLM's block hashes).
        self.keyer: PromptKeyer = TokenKeyer(config.chunk_tokens, fingerprint)

    def _stored_tokens(self, keys: PromptKeys, num_stored_keys: int) -> int:
        """Prompt tokens covered by the leading `num_stored_keys` of `keys.all`."""
        num_chunks = min(num_stored_keys, len(keys.chunks))
        has_tail = num_stored_keys > len(keys.chunks)
        return num_chunks * self.config.chunk_tokens + (keys.tail_tokens if has_tail else 0)

    # ------------------------------------------------------------------ admission
    def num_new_matched_tokens(self, request: Request, num_local: int) -> tuple[int, bool]:
        keys = self.keyer.request_keys(request)
        answer = self.client.ask(["lookup", keys.all]) if keys.all else 0
        num_stored = answer if isinstance(answer, int) else 0
        # NOTE: a memo of the latest answer, overwritten on every call: calling again changes
        # nothing observable; after_alloc consumes it.
        self._lookups[request.request_id] = _Lookup(num_local, num_stored)
        if not self.can_load:
            return 0, False
        # The last prompt token is always computed: its logits give the first output token.
        usable = min(self._stored_tokens(keys, num_stored), request.num_prompt_tokens - 1)
        num_external = max(0, usable - num_local)
        return num_external, num_external > self.config.sync_load_max_tokens

    def after_alloc(self, request: Request, block_ids: list[int], num_external: int) -> None:
        lookup = self._lookups.pop(request.request_id, _Lookup(0, 0))
        keys = self.keyer.request_keys(request)
        num_stored_tokens = self._stored_tokens(keys, lookup.num_stored_keys)
        if num_external and lookup.num_local + num_external > num_stored_tokens:
            raise RuntimeError(f"request {request.request_id}: asked to load {num_external} tokens after "
                               f"{lookup.num_local}, but the lookup found {num_stored_tokens} stored")
        tracked = self._tracked.get(request.request_id)
        num_stored_chunks = min(lookup.num_stored_keys, len(keys.chunks))
        tail_found = lookup.num_stored_keys > len(keys.chunks) or keys.tail is None
        self._tracked[request.request_id] = _Tracked(
            keys, request.num_prompt_tokens, list(block_ids),
            next_chunk=max(num_stored_chunks, tracked.next_chunk if tracked else 0),
            tail_done=tail_found or (tracked is not None and tracked.tail_done),
            token_ids=request.prompt_token_ids)
        if num_external:
            chunks = self._chunk_loads(keys, block_ids, lookup.num_local, lookup.num_local + num_external)
            load_async = num_external > self.config.sync_load_max_tokens
            self._loads.append(LoadJob(request.request_id, chunks, load_async))

    def _chunk_loads(self, keys: PromptKeys, block_ids: list[int], start: int, end: int) -> list[ChunkLoad]:
        """Blocks covering tokens [start, end), grouped by the entry (chunk or tail) that holds
        them. The last block may be partial: the tokens past `end` it receives are recomputed
        identically (or, past the prompt, never read before they are written)."""
        loads: list[ChunkLoad] = []
        first, stop = start // self.block_size, cdiv(end, self.block_size)
        for block in range(first, stop):
            chunk, offset = divmod(block, self.blocks_per_chunk)
            key: str | None = keys.chunks[chunk] if chunk < len(keys.chunks) else keys.tail
            tail_tokens = 0 if chunk < len(keys.chunks) else keys.tail_tokens
            assert key is not None, "a load past the full chunks reads the tail the lookup found"
            if not loads or loads[-1].key != key:
                loads.append(ChunkLoad(key, offset, [], tail_tokens))
            loads[-1].block_ids.append(block_ids[block])
        return loads

    # ------------------------------------------------------------------ each step
    def build_meta(self, scheduler_output: SchedulerOutput) -> OffloadConnectorMetadata:
        meta = OffloadConnectorMetadata(loads=self._loads)
        self._events_due |= bool(self._loads)  # a load may promote chunks into upper tiers
        self._loads = []
        scheduled: list[tuple[str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is None:
                keys = self.keyer.token_keys(new.prompt_token_ids)
                if keys is None:
                    continue  # a request this side never admitted, and cannot key: not stored
                tracked = self._tracked[new.req_id] = _Tracked(keys, len(new.prompt_token_ids), [], 0,
                                                               tail_done=keys.tail is None,
                                                               token_ids=new.prompt_token_ids)
            tracked.block_ids = list(new.block_ids)  # a (re)started request: a fresh block list
            scheduled.append((new.req_id, new.num_computed_tokens))
        for cached in scheduler_output.scheduled_cached_reqs:
            if (tracked := self._tracked.get(cached.req_id)) is not None:
                tracked.block_ids.extend(cached.new_block_ids)
                scheduled.append((cached.req_id, cached.num_computed_tokens))
        if self.can_save:
            meta.saves = self._new_saves(scheduled, scheduler_output.num_scheduled_tokens)
            self._saves_unconfirmed |= bool(meta.saves)
        return meta

    def _new_saves(self, scheduled: list[tuple[str, int]], num_scheduled: dict[str, int]) -> list[ChunkSave]:
        """Entries that this step completes, once per key: each full chunk, and the tail in the
        step that computes the prompt's last token."""
        saves: list[ChunkSave] = []
        keys_saved: set[str] = set()
        for req_id, num_computed in scheduled:
            tracked = self._tracked[req_id]
            num_done = min(num_computed + num_scheduled.get(req_id, 0), tracked.num_prompt_tokens)
            chunks = tracked.keys.chunks
            num_chunks = min(num_done // self.config.chunk_tokens, len(chunks))
            for chunk in range(tracked.next_chunk, num_chunks):
                blocks = tracked.block_ids[chunk * self.blocks_per_chunk:(chunk + 1) * self.blocks_per_chunk]
                if chunks[chunk] not in keys_saved and len(blocks) == self.blocks_per_chunk:
                    keys_saved.add(chunks[chunk])
                    saves.append(ChunkSave(req_id, chunks[chunk], blocks))
                    self._saved_for_events(tracked, chunk)
            tracked.next_chunk = max(tracked.next_chunk, num_chunks)
            if not tracked.tail_done and num_done == tracked.num_prompt_tokens:
                tracked.tail_done = True
                if (save := self._tail_save(req_id, tracked)) is not None and save.key not in keys_saved:
                    keys_saved.add(save.key)
                    saves.append(save)
        return saves

    def _saved_for_events(self, tracked: _Tracked, chunk: int) -> None:
        if self.tier_events is None:
            return
        if tracked.hashes is None:
            tracked.hashes = hash_token_blocks(tracked.token_ids, self.block_size)
        first = chunk * self.blocks_per_chunk
        self.tier_events.saved(tracked.keys.chunks[chunk], tracked.hashes[first - 1] if first else None,
                               tracked.hashes[first:first + self.blocks_per_chunk])
        self._events_due = True

    def take_events(self) -> list[KVEvent]:
        """What the local tiers stored and dropped since the last call, as KV events (read
        while stores are in flight, and once after)."""
        if self.tier_events is None or not self._events_due:
            return []
        self._events_due = self._saves_unconfirmed
        return self.tier_events.take()

    def _tail_save(self, req_id: str, tracked: _Tracked) -> ChunkSave | None:
        keys = tracked.keys
        first = len(keys.chunks) * self.blocks_per_chunk
        num_blocks = cdiv(keys.tail_tokens, self.block_size)
        blocks = tracked.block_ids[first:first + num_blocks]
        if keys.tail is None or len(blocks) != num_blocks:
            return None
        return ChunkSave(req_id, keys.tail, blocks, keys.tail_tokens)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """An entry that failed to load was dropped from the store: store it again once the
        request has recomputed it (the tail, the last entry, always follows a failure)."""
        if not output.invalid_block_ids:
            return
        for tracked in self._tracked.values():
            bad = [i for i, b in enumerate(tracked.block_ids) if b in output.invalid_block_ids]
            if bad:
                tracked.next_chunk = min(tracked.next_chunk, bad[0] // self.blocks_per_chunk)
                tracked.tail_done = tracked.keys.tail is None

    def request_finished(self, request: Request) -> None:
        self._lookups.pop(request.request_id, None)
        self._tracked.pop(request.request_id, None)

    def has_pending_work(self) -> bool:
        """True while chunk stores this side handed out may still be in flight."""
        if not self._saves_unconfirmed:
            return False
        answer = self.client.ask(["pending"])
        self._saves_unconfirmed = isinstance(answer, int) and answer > 0
        return self._saves_unconfirmed
