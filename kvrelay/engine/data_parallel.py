"""DataParallelLLM: several whole engines ("data-parallel ranks") behind one endpoint.

    llm = DataParallelLLM.start(config)      # config.parallel.data_parallel_size ranks
    leg = llm.pick_rank(prompt_token_ids, kv_transfer_params, dp_rank=None)
    async for out in leg.generate(prompt, params, request_id, kv_transfer_params): ...

Each rank is a whole engine: its own LLMEngine (scheduler, scheduler-side connector, output
processor), stepped by its own AsyncLLM thread, and its own worker processes (executor "mp" at
any TP size), which hold its share of the model, its KV cache, its worker-side connector and its
KV side channels. The step loop and the connector contract are a single instance's; what makes
the ranks differ is their config (EngineConfig.for_data_parallel_rank): engine id `<id>_dp<r>`,
KV ports from `kv_port + r * tp_size`, KV events on their own endpoint, tagged with the rank.

The front end (this object, in the server's process) picks a rank for each request with the P/D
proxy's own KV-aware policy (kvrelay.disagg.routing) over a KVIndex fed in-process by every
rank's KV events: the rank whose cached prefix saves the most work against its load (a decode leg
of P/D: the fewest requests in flight, then the longest cached prefix). A caller may name the
rank instead (vLLM's X-data-parallel-rank header). Sampled tokens reach the front end as they
reach any multi-process engine: one pipe from the rank's worker, no extra hop.

Failure isolation: a rank whose worker process dies (or whose engine thread fails) is down; its
requests in flight fail, it takes no new ones, /health names it, and the other ranks go on.
Only when every rank is down does `on_dead` fire (the server then stops).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvrelay.config import EngineConfig
from kvrelay.disagg.routing.kv_index import KVIndex
from kvrelay.disagg.routing.policies import RoutingPolicy, create_policy
from kvrelay.disagg.routing.prompt import PromptBlocks
from kvrelay.engine.async_llm import AsyncLLM, EngineDeadError
from kvrelay.engine.llm_engine import LLMEngine, load_engine_model
from kvrelay.kv_events.base import EventPublisher
from kvrelay.kv_events.events import KVEventBatch
from kvrelay.model.loader import LoadedModel
from kvrelay.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RANK_HEADER = "X-data-parallel-rank"  # vLLM's name, in requests (a caller's pick) and answers


class _IndexFeed(EventPublisher):
    """One rank's KV event batches into the front end's index, in the rank's engine thread."""

    def __init__(self, index: KVIndex, key: str) -> None:
        self.index, self.key = index, key
        self._seq = itertools.count()

    def publish(self, batch: KVEventBatch) -> None:
        self.index.on_batch(self.key, next(self._seq), batch)

    def shutdown(self) -> None:
        return None


@dataclass(eq=False)
class Rank:
    """One rank as the routing policy sees it (a kvrelay.disagg.routing Candidate)."""

    dp_rank: int
    llm: AsyncLLM
    in_flight: int = 0  # requests of this front end running on it
    queued_tokens: int = 0  # prompt tokens they are predicted to compute, until their first token

    @property
    def url(self) -> str:
        return index_key(self.dp_rank)

    @property
    def index_keys(self) -> tuple[str, ...]:
        return (self.url,)


def index_key(dp_rank: int) -> str:
    """A rank's name in the front end's KV index."""
    return f"dp{dp_rank}"


class RankLeg:
    """A request bound for one rank: `generate` runs it there and keeps the rank's load counts."""

    def __init__(self, rank: Rank, index: KVIndex, prompt: PromptBlocks, compute_tokens: int,
                 key: str) -> None:
        self.rank, self.index, self.prompt, self.compute_tokens = rank, index, prompt, compute_tokens
        self.key = key  # the index's handle on this leg's expected blocks

    @property
    def dp_rank(self) -> int:
        return self.rank.dp_rank

    async def generate(self, prompt: dict[str, Any], params: SamplingParams, request_id: str | None = None,
                       kv_transfer_params: dict[str, Any] | None = None) -> AsyncIterator[RequestOutput]:
        rank, index, key = self.rank, self.index, self.key
        started_at = time.monotonic()
        index.expect(rank.url, key, self.prompt)
        rank.in_flight += 1
        rank.queued_tokens += self.compute_tokens
        queued = True
        try:
            async for out in rank.llm.generate(prompt, params, request_id, kv_transfer_params):
                if queued and any(c.token_ids for c in out.outputs):
                    rank.queued_tokens -= self.compute_tokens  # its prompt is computed
                    queued = False
                yield out
        finally:
            rank.in_flight -= 1
            if queued:
                rank.queued_tokens -= self.compute_tokens
            index.settle(rank.url, key, started_at, None, None)


class DataParallelLLM:
    """Serve several ranks (AsyncLLMs of one model) as one engine; see the module docstring."""

    def __init__(self, llms: list[AsyncLLM], index: KVIndex,
                 keepers: list[_EngineThread] | None = None) -> None:
        self.index = index
        self._ranks = [Rank(dp_rank, llm) for dp_rank, llm in enumerate(llms)]
        self._keepers = keepers or []
        self._policies: dict[str, RoutingPolicy] = {
            role: create_policy("kv-aware", role, index) for role in ("prefill", "decode")}
        first = llms[0]
        self.engine: LLMEngine = first.engine  # tokenizer, model spec, config: the same on every rank
        self.model_name = first.model_name
        self.max_model_len = min(llm.max_model_len for llm in llms)
        # Called once, from an engine thread, when the last rank goes down (the server stops on it).
        self.on_dead: Callable[[BaseException], None] | None = None
        self._lock = threading.Lock()
        self._all_down_reported = False
        self._legs = itertools.count()
        for rank in self._ranks:
            rank.llm.on_dead = self._on_rank_dead(rank)

    @classmethod
    def start(cls, config: EngineConfig, threads_per_rank: int | None = None) -> DataParallelLLM:
        """Start every rank of `config` (a data-parallel group), each in its own worker processes,
        in parallel; the model is read once. Any rank failing to start stops the others and
        raises. `threads_per_rank`: torch threads of each rank (default: this process's, split
        between the ranks)."""
        size = config.parallel.data_parallel_size
        if config.parallel.distributed_executor_backend != "mp":
            raise ValueError("data-parallel ranks run their workers in their own processes: use "
                             "distributed_executor_backend='mp' (the default with data_parallel_size > 1)")
        threads = threads_per_rank or max(1, torch.get_num_threads() // size)
        index = KVIndex()
        loaded = load_engine_model(config)
        keepers = [_EngineThread(config.for_data_parallel_rank(r), _copy(loaded),
                                 _IndexFeed(index, index_key(r)), threads) for r in range(size)]
        for keeper in keepers:
            keeper.start()
        engines: list[LLMEngine] = []
        failure: BaseException | None = None
        for keeper in keepers:
            try:
                engines.append(keeper.engine.result())
            except BaseException as e:  # noqa: BLE001 - the first failure is raised once all settled
                failure = failure or e
        if failure is not None:
            for engine in engines:
                engine.shutdown()
            for keeper in keepers:
                keeper.release()
            raise failure
        for r, engine in enumerate(engines):
            index.track(index_key(r), subscribed=True, block_size=engine.config.cache.block_size)
            logger.info("data-parallel rank %d: %s", r, describe_rank(engine.config))
        return cls([AsyncLLM(engine) for engine in engines], index, keepers)

    # ----------------------------------------------------------------------------- requests
    def pick_rank(self, prompt_token_ids: list[int], kv_transfer_params: dict[str, Any] | None,
                  dp_rank: int | None = None) -> RankLeg:
        """The rank for a request: `dp_rank` when the caller names one (ValueError when there is
        no such rank, EngineDeadError when it is down), else the routing policy's pick among the
        ranks that are up (EngineDeadError when none is)."""
        prompt = PromptBlocks(prompt_token_ids)
        if dp_rank is not None:
            if not 0 <= dp_rank < len(self._ranks):
                raise ValueError(f"data_parallel_rank {dp_rank} is out of range [0, {len(self._ranks)}).")
            rank = self._ranks[dp_rank]
            reason = rank.llm.dead_reason
            if reason is not None:
                raise EngineDeadError(f"data-parallel rank {dp_rank} is down: {reason}")
            cached = self.index.prefix_hit_tokens(rank.url, prompt) or 0
            return self._leg(rank, prompt, prompt.num_tokens - cached)
        up = [rank for rank in self._ranks if rank.llm.dead_reason is None]
        if not up:
            raise EngineDeadError(self.dead_reason or "every data-parallel rank is down")
        params = kv_transfer_params or {}
        role = "decode" if params.get("do_remote_prefill") else "prefill"
        decision = self._policies[role].choose(up, prompt)
        return self._leg(decision.backend, prompt, decision.compute_tokens)

    def release_remote_kv(self, prompt_token_ids: list[int], kv_transfer_params: dict[str, Any]) -> None:
        """A request refused before any rank saw it frees the KV a prefill instance holds for
        it, through the first rank that is up: every rank's connector tells P alike (each is a
        whole decode instance of the same TP size). Nothing when every rank is down."""
        up = next((rank.llm for rank in self._ranks if rank.llm.dead_reason is None), None)
        if up is not None:
            up.release_remote_kv(prompt_token_ids, kv_transfer_params)

    def _leg(self, rank: Rank, prompt: PromptBlocks, compute_tokens: int) -> RankLeg:
        return RankLeg(rank, self.index, prompt, compute_tokens, f"leg-{next(self._legs)}")

    # ----------------------------------------------------------------------------- state
    @property
    def ranks(self) -> list[AsyncLLM]:
        return [rank.llm for rank in self._ranks]

    @property
    def dead_reason(self) -> str | None:
        """None while some rank is up."""
        reasons = [(rank.dp_rank, rank.llm.dead_reason) for rank in self._ranks]
        if any(reason is None for _, reason in reasons):
            return None
        return "every data-parallel rank is down: " + "; ".join(f"rank {r}: {why}" for r, why in reasons)

    @property
    def crashed(self) -> bool:
        """Whether some rank died of an error (not a shutdown)."""
        return any(rank.llm.crashed for rank in self._ranks)

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /health: 200 while some rank is up ("degraded" when not all
        are), each rank's state and, for a rank that is down, why."""
        ranks = []
        for rank in self._ranks:
            reason = rank.llm.dead_reason
            report: dict[str, Any] = {"dp_rank": rank.dp_rank, "status": "ok" if reason is None else "down",
                                      "in_flight": rank.in_flight}
            transfer = rank.llm.engine.config.kv_transfer
            if transfer is not None and transfer.kv_connector is not None:
                report["engine_id"] = transfer.engine_id
            if reason is not None:
                report["reason"] = reason
            ranks.append(report)
        num_up = sum(report["status"] == "ok" for report in ranks)
        status = "ok" if num_up == len(ranks) else "degraded" if num_up else "unhealthy"
        return (200 if num_up else 503), {"status": status, "data_parallel_size": len(ranks), "ranks": ranks}

    def _on_rank_dead(self, rank: Rank) -> Callable[[BaseException], None]:
        def died(error: BaseException) -> None:
            # NOTE: a rank's dead_reason is set before its on_dead runs, so the last of several
            # ranks dying at once finds none up; the lock makes only one of them report it.
            with self._lock:
                up = [r.dp_rank for r in self._ranks if r.llm.dead_reason is None]
                report = not up and not self._all_down_reported
                self._all_down_reported |= report
            logger.error("data-parallel rank %d is down (%s: %s); ranks still serving: %s", rank.dp_rank,
                         type(error).__name__, error, up or "none")
            if report and self.on_dead is not None:
                self.on_dead(error)
        return died

    def shutdown(self) -> None:
        """Stop every rank's engine thread, workers and connectors. Safe to call twice."""
        for rank in self._ranks:
            rank.llm.shutdown()
        for rank in self._ranks:
            try:
                rank.llm.engine.shutdown()
            except Exception:
                logger.exception("error while shutting data-parallel rank %d down", rank.dp_rank)
        for keeper in self._keepers:
            keeper.release()


class _EngineThread(threading.Thread):
    """Builds one rank's LLMEngine, then stays until released. NOTE: a worker process gets
    SIGKILL when the thread that started it ends (PR_SET_PDEATHSIG, executor/worker_proc.py), so
    the thread that builds a rank must outlive the rank's engine."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel, sink: EventPublisher, threads: int) -> None:
        super().__init__(name=f"kvrelay-dp{config.parallel.data_parallel_rank}-start", daemon=True)
        self.config, self.loaded, self.sink, self.threads = config, loaded, sink, threads
        self.engine: Future[LLMEngine] = Future()
        self._released = threading.Event()

    def run(self) -> None:
        torch.set_num_threads(self.threads)  # NOTE: per thread under OpenMP; the workers split it
        try:
            self.engine.set_result(LLMEngine(self.config, self.loaded, event_sink=self.sink))
        except BaseException as e:  # noqa: BLE001 - handed to the starting thread
            self.engine.set_exception(e)
            return
        finally:
            self.loaded = None  # type: ignore[assignment]  # the weights belong to the engine now
        self._released.wait()

    def release(self) -> None:
        self._released.set()
        self.join(timeout=5.0)


def _copy(loaded: LoadedModel) -> LoadedModel:
    """A LoadedModel an engine may consume (it empties `weights`) sharing the tensors."""
    return dataclasses.replace(loaded, weights=dict(loaded.weights))


def describe_rank(config: EngineConfig) -> str:
    """One line on where a rank's KV lives, for the log."""
    parts = [f"device {config.model.device}"]
    transfer = config.kv_transfer
    if transfer is not None and transfer.kv_connector is not None:
        tp = config.parallel.tensor_parallel_size
        last = transfer.kv_port + tp - 1
        ports = str(transfer.kv_port) if tp == 1 else f"{transfer.kv_port}-{last}"
        parts.append(f"engine {transfer.engine_id}, KV ports {ports}")
    events = config.kv_events
    if events is not None and events.publishes:
        parts.append(f"KV events {events.endpoint}")
    return ", ".join(parts)
