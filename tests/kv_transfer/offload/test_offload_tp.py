"""OffloadConnector under tensor parallelism: each rank stores its own KV heads under keys of its
own (`tp<size>-rank<rank>`), so a TP 2 store is reused at TP 2 with TP 1's tokens and a TP 1
store in the same tier is never read at TP 2; a chunk counts as stored only when every rank's
store holds it."""

from __future__ import annotations

import uuid
from pathlib import Path

from kvrelay import LLM
from kvrelay.kv_transfer.offload.lookup import LookupClient, LookupServer, ShardedLookupClient, lookup_address
from tests.kv_transfer.offload.helpers import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    assert_no_leak,
    fresh_prefix_cache,
    generate,
    offload_config,
    prompts_of,
    reference_tokens,
    stored_prefix,
)
from tests.tiny import tiny_loaded_model

PROMPTS = prompts_of([37, 20], seed=5)


def make_llm(config: dict, tp: int) -> LLM:
    return LLM(loaded_model=tiny_loaded_model("llama"), num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
               kv_transfer_config=config, tensor_parallel_size=tp)


def external_tokens(llm: LLM) -> int:
    return int(llm.engine.get_stats()["prompt_tokens_external"])


def test_tp2_disk_store_is_reused_at_tp2_and_a_tp1_store_is_not_mistaken_for_it(tmp_path: Path) -> None:
    want = reference_tokens(PROMPTS)
    config = offload_config(disk_dir=str(tmp_path), disk_bytes="64MiB")
    tp1 = make_llm(config, tp=1)
    assert generate(tp1, PROMPTS) == want
    tp1.shutdown()
    tp2 = make_llm(config, tp=2)
    try:
        assert generate(tp2, PROMPTS) == want
        assert external_tokens(tp2) == 0  # the TP 1 chunks in the same directory are no hit
        fresh_prefix_cache(tp2)
        assert generate(tp2, PROMPTS) == want
        assert external_tokens(tp2) == sum(stored_prefix(p) for p in PROMPTS)  # both ranks' shards
        assert_no_leak(tp2)
    finally:
        tp2.shutdown()


def test_a_chunk_counts_as_stored_only_when_every_rank_holds_it() -> None:
    engine_id, extra = f"test-{uuid.uuid4().hex[:8]}", {"chunk_tokens": 16}
    held = {"tp2-rank0": 3, "tp2-rank1": 1}
    servers = [LookupServer(lookup_address(engine_id, extra, shard),
                            lambda message, n=n: n if message[0] == "lookup" else 2)
               for shard, n in held.items()]
    client = ShardedLookupClient([LookupClient(lookup_address(engine_id, extra, shard)) for shard in held])
    try:
        assert client.ask(["lookup", ["a", "b", "c"]]) == 1  # rank 1 holds only the first
        assert client.ask(["pending"]) == 4  # stores in flight add up over the ranks
        servers[1].close()
        client.clients[1].close()
        client.clients[1].address = lookup_address(engine_id, extra, "tp2-rank9")  # nobody there
        assert client.ask(["lookup", ["a"]]) is None  # an unreachable rank: no hit at all
    finally:
        client.close()
        for server in servers:
            server.close()
