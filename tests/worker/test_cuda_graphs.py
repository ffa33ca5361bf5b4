"""Decode steps through the captured-graph path: the static buffers, the padding and the sizes.

A CUDA graph needs a GPU; the capture is a seam, so here a capture that runs the model again at
every replay exercises everything else (which buffers a replay reads, padding to the captured
size with rows that write no KV and read no block) on the Triton route under the interpreter.
The real capture is checked by the GPU tests (tests/gpu)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.worker.cuda_graphs import DecodeGraphs, capture_sizes
from tests.tiny import tiny_loaded_model

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 9, 40] * (2 + i)} for i in range(3)]


class RerunCapture:
    """A 'graph' that runs the captured function again at each replay, into the same output."""

    def __init__(self) -> None:
        self.replays = 0

    def capture(self, run: Callable[[], torch.Tensor]):  # type: ignore[no-untyped-def]
        out = run()
        capture = self

        class Replay:
            def replay(self) -> None:
                capture.replays += 1
                out.copy_(run())

        return Replay(), out


def tiny_llm(**options) -> LLM:  # type: ignore[no-untyped-def]
    return LLM(loaded_model=tiny_loaded_model("llama", head_dim=16), num_blocks=64, block_size=4,
               max_num_seqs=8, **options)


def test_the_captured_sizes_are_1_2_4_8_then_every_8_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert capture_sizes(30) == [1, 2, 4, 8, 16, 24, 30]


def test_decode_steps_replayed_through_graph_buffers_give_the_eager_tokens() -> None:
    reference = [o.outputs[0].token_ids for o in tiny_llm().generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = tiny_llm(attention_backend="triton")
    runner = llm.engine.runner
    capture = RerunCapture()
    runner.graphs = DecodeGraphs(runner.model, runner.backend, list(runner.kv_caches), 8,
                                 llm.engine.max_model_len, 4, runner.device, capture=capture)
    runner.graphs.capture_all()
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == reference
    assert capture.replays >= 5, "the decode steps of 3 sequences (padded to 4) replayed"
    assert llm.engine.blocks_in_use == 0


def test_a_step_the_graphs_cannot_run_is_refused() -> None:
    llm = tiny_llm(attention_backend="triton")
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.backend, list(runner.kv_caches), 2,
                          llm.engine.max_model_len, 4, runner.device, capture=RerunCapture())
    assert graphs.padded_size(2) == 2 and graphs.padded_size(3) is None
    from kvrelay.attention.metadata import StepBatch

    prefill = StepBatch.from_lists([3], [3], [[0]], 4, runner.device)
    with pytest.raises(ValueError, match="no captured graph runs a step of 1 sequences"):
        graphs.run(prefill, torch.zeros(3, dtype=torch.int64))


def test_a_connector_with_layer_work_keeps_decode_steps_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = tiny_llm(attention_backend="triton")
    runner = llm.engine.runner
    capture = RerunCapture()
    runner.graphs = DecodeGraphs(runner.model, runner.backend, list(runner.kv_caches), 8,
                                 llm.engine.max_model_len, 4, runner.device, capture=capture)
    runner.graphs.capture_all()
    monkeypatch.setattr(runner.connector, "uses_layer_hooks", lambda: True)
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert capture.replays == 0
