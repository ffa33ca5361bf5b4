"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, params)`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from tqdm.auto import tqdm

from kvrelay import env
from kvrelay.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, parse_size
from kvrelay.engine.llm_engine import LLMEngine, PromptType
from kvrelay.kv_events.config import KVEventsConfig
from kvrelay.model.loader import LoadedModel
from kvrelay.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams


class LLM:
    """An engine for offline batches. Arguments mirror vLLM's where they exist:

    LLM(model=None, device="auto", dtype="auto", block_size=16, kv_cache_memory=None,
        gpu_memory_utilization=0.9, kv_cache_dtype="auto", max_num_seqs=64, max_num_batched_tokens=2048,
        max_model_len=None, enable_prefix_caching=True, seed=0, kv_transfer_config=None,
        tensor_parallel_size=1, distributed_executor_backend=None, enforce_eager=False,
        attention_backend="auto", kv_events_config=None, chat_template=None, batch_invariant=None)
    `model=None` is the embedded SmolLM2-135M-Instruct. `device`: auto (a GPU when one is visible,
    else the CPU), cpu, cuda or cuda:N. `dtype="auto"`: float32 on the CPU, the checkpoint's dtype
    on a GPU. `kv_cache_memory` (bytes, or "1GiB"): None is 512MiB on the CPU; on a GPU the cache
    gets what `gpu_memory_utilization` (the share of the GPU's memory this instance may use) leaves
    after the weights. `kv_cache_dtype`: what the KV cache stores, independent of `dtype`
    (kvrelay/attention/kv_format.py). `enforce_eager`: no CUDA graphs. `attention_backend`: auto,
    cpu, torch or triton (kvrelay/config.py). `kv_events_config`: vLLM's KV events (docs/routing.md).
    `chat_template`: a Jinja template (its text) that `chat` uses instead of the model's own.
    `batch_invariant`: a request's logprobs bitwise the same whatever it is batched with
    (docs/batch_invariance.md); None: `KVRELAY_BATCH_INVARIANT`, else off.
    """

    def __init__(self, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
                 block_size: int = 16, kv_cache_memory: int | str | None = None,
                 gpu_memory_utilization: float = 0.9, kv_cache_dtype: str = "auto",
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
                 max_model_len: int | None = None, enable_prefix_caching: bool = True,
                 long_prefill_token_threshold: int = 0, num_blocks: int | None = None,
                 seed: int = 0, kv_transfer_config: Any = None, tensor_parallel_size: int = 1,
                 distributed_executor_backend: str | None = None, enforce_eager: bool = False,
                 attention_backend: str = "auto", loaded_model: LoadedModel | None = None,
                 kv_events_config: Any = None, chat_template: str | None = None,
                 batch_invariant: bool | None = None) -> None:
        kv_transfer = None
        if kv_transfer_config is not None:
            from kvrelay.kv_transfer.config import KVTransferConfig
            kv_transfer = KVTransferConfig.from_any(kv_transfer_config)
        config = EngineConfig(
            model=ModelConfig(model=model, dtype=dtype, device=device, max_model_len=max_model_len,
                              seed=seed, enforce_eager=enforce_eager, attention_backend=attention_backend,
                              chat_template=chat_template,
                              batch_invariant=(env.batch_invariant() if batch_invariant is None
                                               else batch_invariant)),
            cache=CacheConfig(block_size=block_size, kv_cache_memory=_bytes_or_none(kv_cache_memory),
                              gpu_memory_utilization=gpu_memory_utilization,
                              enable_prefix_caching=enable_prefix_caching,
                              num_blocks_override=num_blocks, cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      long_prefill_token_threshold=long_prefill_token_threshold),
            parallel=ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                    distributed_executor_backend=distributed_executor_backend),
            kv_transfer=kv_transfer, kv_events=KVEventsConfig.from_any(kv_events_config))
        self.engine = LLMEngine(config, loaded=loaded_model)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; returns the final outputs in prompt order. A prompt is a
        string or {"prompt_token_ids": [...]}. Invalid prompts raise before any work starts.
        With `SamplingParams(n=k)` an output holds k completions (index 0..k-1) sharing the
        prompt's KV (kvrelay.engine.parallel_sampling)."""
        prompt_list = self._as_list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompt_list):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompt_list)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        tokenized = [self.engine.tokenize(p) for p in prompt_list]
        for _, token_ids in tokenized:  # validate everything before queueing anything
            self.engine.validate_prompt(token_ids)
        ids = [self.engine.add_request({"prompt": text, "prompt_token_ids": token_ids}, sp)
               for (text, token_ids), sp in zip(tokenized, params_list, strict=True)]
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate.
        The template writes the model's special tokens itself, so encoding adds none (as the
        server's chat route and vLLM do)."""
        conversations = cast(list[list[dict[str, str]]],
                             messages if messages and isinstance(messages[0], list) else [messages])
        prompts: list[PromptType] = [chat_prompt(self.tokenizer, conv, add_generation_prompt)
                                     for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    @staticmethod
    def _as_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
        if isinstance(prompts, str | dict):
            return [prompts]
        prompt_list = list(prompts)
        if prompt_list and all(isinstance(t, int) for t in prompt_list):
            return [cast(list[int], prompt_list)]  # a single prompt given as token ids
        return cast(list[PromptType], prompt_list)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", disable=not use_tqdm)
        try:
            while len(final) < len(request_ids):
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                        bar.update(1)
        finally:
            bar.close()
            unfinished = [rid for rid in request_ids if rid not in final]
            if unfinished:  # interrupted: leave nothing of these requests in the engine
                self.engine.abort_request(unfinished)
                self.engine.step()
        # Let this instance's own side effects land (connector stores, loads of aborted
        # requests). Blocks held for another instance to read settle on its schedule, in later
        # steps: `self.engine.run_until_idle()` waits for those too.
        self.engine.run_until_idle(include_held=False)
        return [final[rid] for rid in request_ids]

    def shutdown(self) -> None:
        """Stop the connectors' background threads (side channels, transports)."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def chat_prompt(tokenizer: Any, messages: list[dict[str, str]],
                add_generation_prompt: bool = True) -> dict[str, Any]:
    """One conversation as the model's chat template renders it, with its token ids. The template
    writes the special tokens itself, so encoding adds none (as the server and vLLM do)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _bytes_or_none(size: int | str | None) -> int | None:
    return None if size is None else parse_size(size, "kv_cache_memory")
