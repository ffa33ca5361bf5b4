"""ExampleConnector under tensor parallelism: each rank stores its own KV heads in its own entry;
a TP 2 store is reused at TP 2 with TP 1's tokens, a TP 1 store is never mistaken for a TP 2 one,
and a prefix that one rank lacks is no hit at all."""

from __future__ import annotations

import shutil
from pathlib import Path

from kvrelay import LLM, SamplingParams
from tests.tiny import tiny_loaded_model

BLOCK_SIZE = 4
PROMPT = {"prompt_token_ids": [3 + (7 * i) % 200 for i in range(19)]}  # 16 storable tokens
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_llm(storage: Path, tp: int) -> LLM:
    return LLM(loaded_model=tiny_loaded_model("llama"), num_blocks=32, block_size=BLOCK_SIZE,
               enable_prefix_caching=False, tensor_parallel_size=tp,
               kv_transfer_config={"kv_connector": "ExampleConnector",
                                   "kv_connector_extra_config": {"shared_storage_path": str(storage)}})


def generate(llm: LLM) -> tuple[list[int], int]:
    """The greedy tokens, and the prompt tokens this request loaded from the connector."""
    before = llm.engine.get_stats()["prompt_tokens_external"]
    tokens = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    return tokens, llm.engine.get_stats()["prompt_tokens_external"] - before


def test_tp2_store_is_reused_at_tp2_and_never_mixed_with_tp1(tmp_path: Path) -> None:
    tp1 = make_llm(tmp_path, tp=1)
    want, loaded = generate(tp1)
    assert loaded == 0
    tp1.shutdown()
    (tp1_entry,) = [p.name for p in tmp_path.iterdir()]

    tp2 = make_llm(tmp_path, tp=2)
    try:
        tokens, loaded = generate(tp2)
        assert (tokens, loaded) == (want, 0)  # the TP 1 entry is not a TP 2 hit
        tp2_entries = sorted(p.name for p in tmp_path.iterdir() if p.name != tp1_entry)
        key = tp2_entries[0].split(".")[0]
        assert tp2_entries == [f"{key}.tp2-rank0", f"{key}.tp2-rank1"]
        tokens, loaded = generate(tp2)
        assert (tokens, loaded) == (want, 16)  # both ranks' shards loaded
        shutil.rmtree(tmp_path / f"{key}.tp2-rank1")
        tokens, loaded = generate(tp2)
        assert (tokens, loaded) == (want, 0)  # rank 1 lacks it: no hit (and it is stored again)
        assert (tmp_path / f"{key}.tp2-rank1").is_dir()
        assert tp2.engine.blocks_in_use == 0 and not tp2.engine.has_pending_work()
    finally:
        tp2.shutdown()
