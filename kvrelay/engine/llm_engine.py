"""LLMEngine: one instance's scheduler, model runner and output processor, stepped together."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from typing import Any

import torch

from kvrelay.config import EngineConfig, resolve_device, resolve_dtype
from kvrelay.core.scheduler import Scheduler
from kvrelay.engine.output_processor import OutputProcessor
from kvrelay.engine.parallel_sampling import ParallelSampling
from kvrelay.executor import create_executor
from kvrelay.kv_events.base import EventPublisher, FanOutPublisher
from kvrelay.kv_transfer import wakeup
from kvrelay.kv_transfer.protocols import SchedulerConnector
from kvrelay.model.loader import LoadedModel, checkpoint_dtype, load_model, weights_dtype
from kvrelay.model.sharding import check_tensor_parallel, shard_layout, shard_spec
from kvrelay.outputs import RequestOutput
from kvrelay.request import Request, RequestStatus
from kvrelay.sampling_params import SamplingParams
from kvrelay.worker.kv_setup import build_kv_setup
from kvrelay.worker.model_runner import ModelRunner, kv_block_bytes, torch_dtype
from kvrelay.worker.worker import WorkerPlan, kv_cache_spec

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
IDLE_STEP_SLEEP_S = 0.0005


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None,
                 event_sink: EventPublisher | None = None) -> None:
        """`event_sink`: also hand each step's KV events to it (a data-parallel front end's KV
        index), whether or not `config` publishes them over ZeroMQ."""
        if config.parallel.is_data_parallel_group:
            raise ValueError(f"data_parallel_size={config.parallel.data_parallel_size} describes several "
                             "engines: start them with kvrelay.engine.data_parallel.DataParallelLLM, or "
                             "run one with config.for_data_parallel_rank(rank)")
        mcfg = config.model
        if loaded is None:
            config = _with_dtype(config, checkpoint_dtype(mcfg.model))
            loaded = load_engine_model(config)
        else:
            config = _with_dtype(config, weights_dtype(loaded.weights))
        self.config = config
        self.spec = loaded.spec
        tp_size = config.parallel.tensor_parallel_size
        check_tensor_parallel(self.spec, tp_size)
        # The spec of the model one rank runs: its KV heads size the blocks and the connectors.
        self.rank_spec = shard_spec(self.spec, shard_layout(self.spec, 0, tp_size))
        self.tokenizer = loaded.tokenizer
        if mcfg.chat_template is not None:  # before the stop ids below: its end-of-turn token stops
            self.tokenizer.set_chat_template(mcfg.chat_template)
        self.model_name = mcfg.served_model_name or loaded.name
        # Format, fp8 scales and compatibility fingerprint, from the whole (unsharded) model.
        self.kv = build_kv_setup(config, self.spec, loaded.weights, torch_dtype(config.model.dtype),
                                 torch.device(config.model.device))
        self.eos_token_ids = tuple(sorted(set(self.tokenizer.stop_token_ids) | set(self.spec.eos_token_ids)))
        plan = WorkerPlan(config=config, spec=self.spec, eos_token_ids=self.eos_token_ids, kv=self.kv)
        # NOTE: the scheduler side's connector first, as before the workers existed (it needs no
        # block count); it is shut down again if the workers cannot start.
        connector = self._build_scheduler_connector(config)
        # NOTE: "mp" workers load a model path themselves (memory-mapped); an in-memory model's
        # tensors are handed over. The engine keeps no reference to the weights after this.
        in_memory = loaded.source == "memory" or config.parallel.distributed_executor_backend == "uni"
        weights, loaded.weights = (loaded.weights if in_memory else None), {}
        try:
            self.executor = create_executor(plan, weights, None if in_memory else loaded.source)
        except BaseException:
            if connector is not None:
                connector.shutdown()
            raise
        del weights
        try:
            # NOTE: the workers measure what they can hold first; the cache (and the context
            # length it allows) is then the same on every rank.
            self.num_blocks = self._num_blocks(config)
            self.max_model_len = self._max_model_len(config)
            self.executor.initialize_kv_cache(self.num_blocks, self.max_model_len)
            self.scheduler = Scheduler(config, self.num_blocks, self.max_model_len, connector,
                                       self._build_event_publisher(config, event_sink))
        except BaseException:
            if connector is not None:
                connector.shutdown()
            self.executor.shutdown()
            raise
        self.output_processor = OutputProcessor(self.tokenizer)
        self.parallel = ParallelSampling(self.add_request, lambda rid: rid in self.scheduler.requests,
                                         stagger=config.cache.enable_prefix_caching)
        self._ids = itertools.count()

    @property
    def runner(self) -> ModelRunner:
        """The in-process model runner (executor `uni` only)."""
        worker = getattr(self.executor, "worker", None)
        if worker is None:
            backend = self.config.parallel.distributed_executor_backend
            raise AttributeError(f"the model runners of executor {backend!r} live in other processes")
        runner: ModelRunner = worker.runner
        return runner

    def _num_blocks(self, config: EngineConfig) -> int:
        ccfg = config.cache
        num_blocks = self.executor.determine_num_blocks()
        if num_blocks < 2:
            per_block = kv_block_bytes(self.rank_spec, ccfg.block_size, self.kv.format.name)
            budget = ccfg.kv_cache_memory if ccfg.kv_cache_memory is not None else num_blocks * per_block
            raise ValueError(f"kv_cache_memory={budget} bytes holds {num_blocks} blocks of "
                             f"{per_block} bytes; give the KV cache at least {2 * per_block} bytes")
        return num_blocks

    def _max_model_len(self, config: EngineConfig) -> int:
        limit = self.spec.max_position_embeddings
        wanted = config.model.max_model_len or limit
        if wanted > limit:
            raise ValueError(f"max_model_len={wanted} exceeds the model's context length {limit}")
        pool_tokens = self.num_blocks * config.cache.block_size
        if wanted > pool_tokens:
            logger.warning("max_model_len lowered from %d to %d: the KV cache holds only %d blocks",
                           wanted, pool_tokens, self.num_blocks)
        return min(wanted, pool_tokens)

    def _build_scheduler_connector(self, config: EngineConfig) -> SchedulerConnector | None:
        if config.kv_transfer is None or config.kv_transfer.kv_connector is None:
            return None
        from kvrelay.kv_transfer.base import KVConnectorRole
        from kvrelay.kv_transfer.factory import create_connector
        connector: SchedulerConnector = create_connector(config, KVConnectorRole.SCHEDULER,
                                                         self.kv_cache_spec())
        return connector

    def _build_event_publisher(self, config: EngineConfig, event_sink: EventPublisher | None
                               ) -> EventPublisher | None:
        rank = config.parallel.data_parallel_rank or 0
        publishers = [] if event_sink is None else [event_sink]
        if config.kv_events is not None and config.kv_events.publishes:
            from kvrelay.kv_events.zmq_publisher import create_publisher
            publishers.insert(0, create_publisher(config.kv_events, rank))
        if not publishers:
            return None
        if len(publishers) == 1 and event_sink is None:
            return publishers[0]
        return FanOutPublisher(publishers, rank)

    def kv_cache_spec(self) -> Any:
        """The KVCacheSpec of one rank's cache."""
        return kv_cache_spec(self.config, self.rank_spec, self.kv)

    # ----------------------------------------------------------------------------- requests
    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> str:
        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt(token_ids)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if params.n > 1:  # n child requests, merged back into this id's outputs
            self.parallel.add(request_id, {"prompt": text, "prompt_token_ids": token_ids}, params,
                              kv_transfer_params)
            return request_id
        request = Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                          eos_token_ids=self.eos_token_ids, kv_transfer_params=kv_transfer_params)
        self.scheduler.add_request(request)
        self.output_processor.add_request(request_id, text, token_ids, params)
        return request_id

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError(
                f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, list | tuple):
            return None, list(prompt)
        raise ValueError(
            f"a prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}")

    def validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: give at least one token")
        vocab = self.spec.vocab_size
        for i, tok in enumerate(token_ids):
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < vocab:
                raise ValueError(f"prompt token id {tok!r} at position {i} is outside the vocabulary "
                                 f"[0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, but the context length "
                             f"(max_model_len) is {self.max_model_len}: at most {self.max_model_len - 1} "
                             "prompt tokens leave room for one output token")

    def release_remote_kv(self, prompt_token_ids: list[int], kv_transfer_params: dict[str, Any]) -> None:
        """A request this instance refused before queueing it still frees the KV a prefill
        instance holds for it (its kv_transfer_params name that KV): the connector tells P at
        once, as for a request aborted before its admission."""
        request = Request(request_id=f"refused-{next(self._ids)}", prompt_token_ids=list(prompt_token_ids),
                          sampling_params=SamplingParams(max_tokens=1), eos_token_ids=self.eos_token_ids,
                          kv_transfer_params=dict(kv_transfer_params))
        self.scheduler.release_refused(request)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = self.parallel.abort([request_ids] if isinstance(request_ids, str) else list(request_ids))
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)

    # ----------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        sched_out = self.scheduler.schedule()
        runner_out = self.executor.execute_model(sched_out)
        core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        outputs, stopped = self.output_processor.process(core_outputs)
        for req_id, stop in stopped.items():  # a stop string ends the request outside the step
            self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_STOPPED, stop_reason=stop,
                                           report=False)
        outputs = self.parallel.process(outputs)
        if sched_out.is_empty and not outputs:
            # NOTE: nothing ran: only transfers are in flight. Yield the GIL (and the core) to
            # the connector's threads instead of spinning, or a loop of empty steps starves them;
            # a connector thread with news for this loop wakes it early (kv_transfer.wakeup).
            wakeup.wait(IDLE_STEP_SLEEP_S)
        return outputs

    def check_health(self) -> None:
        """Raise WorkerFailedError if a worker process is known to be gone (no message is sent)."""
        self.executor.check_health()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_work(self, include_held: bool = True) -> bool:
        return self.scheduler.has_pending_work(include_held)

    def run_until_idle(self, timeout_s: float = 60.0, include_held: bool = True) -> None:
        """Step until no request, transfer or held block remains (used after the last output).
        include_held=False does not wait for blocks held for another instance to read."""
        deadline = time.monotonic() + timeout_s
        while self.has_pending_work(include_held):
            if time.monotonic() > deadline:
                raise TimeoutError("the engine still has pending work after "
                                   f"{timeout_s:.0f} s: {self.scheduler.stats.as_dict()}")
            self.step()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_external: bool = False) -> bool:
        """vLLM's reset: forget every cached prefix; False while blocks are held (see
        Scheduler.reset_prefix_cache). `reset_external`: the connector's own cache too (a
        connector that keeps none, or cannot reset it, counts as done, as in vLLM)."""
        reset = self.scheduler.reset_prefix_cache(reset_running_requests)
        if reset_external:
            external = self.scheduler.connector.reset_cache()
            if external is None:
                logger.info("reset_prefix_cache: the KV connector keeps no cache it can reset")
            reset = reset and external is not False
        logger.info("reset_prefix_cache: %s", "done" if reset else "refused: blocks are still in use")
        return reset

    def shutdown(self) -> None:
        """Stop the workers and the connectors' threads and transports. Idempotent; the engine is
        unusable after."""
        self.scheduler.connector.shutdown()
        self.scheduler.kv_event_publisher.shutdown()
        self.executor.shutdown()

    # ----------------------------------------------------------------------------- introspection
    @property
    def blocks_in_use(self) -> int:
        return self.scheduler.blocks_in_use

    def get_stats(self) -> dict[str, Any]:
        stats = self.scheduler.stats.as_dict()
        stats.update(
            num_blocks=self.num_blocks, blocks_in_use=self.blocks_in_use,
            num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
            num_waiting_for_remote_kv=self.scheduler.num_waiting_for_remote_kv,
            kv_cache_dtype=self.kv.format.name, kv_bytes_per_token=self.kv.bytes_per_token)
        return stats


def load_engine_model(config: EngineConfig) -> LoadedModel:
    """The model `config` names, loaded as an engine loads it (--dtype auto resolved from the
    checkpoint); several engines of one model can share it (LLMEngine's `loaded`)."""
    config = _with_dtype(config, checkpoint_dtype(config.model.model))
    return load_model(config.model.model, dtype=torch_dtype(config.model.dtype))


def _with_dtype(config: EngineConfig, checkpoint: str | None) -> EngineConfig:
    """`config` with --device auto and --dtype auto resolved (the checkpoint's dtype on a GPU)."""
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device, checkpoint)
    if (device, dtype) == (config.model.device, config.model.dtype):
        return config
    return dataclasses.replace(config, model=dataclasses.replace(config.model, device=device, dtype=dtype))
