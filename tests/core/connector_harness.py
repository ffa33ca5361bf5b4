"""Shared set-up for the scheduler-with-connector tests: a FakeConnector on both halves, a runner
that passes the connector metadata through bytes, and small step helpers."""

from __future__ import annotations

from typing import Any

from kvrelay.core.sched_output import SchedulerOutput
from kvrelay.core.scheduler import Scheduler
from kvrelay.kv_transfer import KVCacheSpec, KVConnectorMetadata, KVConnectorRole, KVTransferConfig, add_stats
from kvrelay.outputs import EngineCoreOutput, KVConnectorOutput, ModelRunnerOutput
from tests.helpers import FakeRunner, make_config, make_request, run_to_completion
from tests.kv_transfer.fake_connector import FakeConnector, fake_transfer_config

BLOCK_SIZE = 4
KV_SPEC = KVCacheSpec(block_size=BLOCK_SIZE, num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32")
P2P_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": [0, 1, 2]}


class ConnectorRunner(FakeRunner):
    """The FakeRunner plus the worker half of the FakeConnector: each step binds the metadata
    (sent as bytes, as across a process boundary) and reports what the worker settled, merged
    with any KVConnectorOutput queued in `kv_out` for that step."""

    def __init__(self, worker: FakeConnector) -> None:
        super().__init__(BLOCK_SIZE)
        self.worker = worker

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        out = super().execute(so)
        self.worker.bind_connector_metadata(KVConnectorMetadata.from_bytes(so.kv_connector_metadata.to_bytes()))
        settled = self.worker.get_finished(so.finished_req_ids)
        self.worker.clear_connector_metadata()
        if out.kv_connector_output is not None:
            queued = out.kv_connector_output
            settled.finished_sending |= queued.finished_sending
            settled.finished_recving |= queued.finished_recving
            settled.failed_recving |= queued.failed_recving
            settled.invalid_block_ids |= queued.invalid_block_ids
            add_stats(settled.stats, queued.stats)
        out.kv_connector_output = settled
        return out


def setup(num_blocks: int = 64, policy: str = "recompute", max_num_seqs: int = 16,
          max_num_batched_tokens: int = 64, **extra: Any) -> tuple[Scheduler, FakeConnector, ConnectorRunner]:
    """A scheduler with the scheduler-side FakeConnector, and a runner with the worker side;
    both halves are built from the same extra config (rules, script, auto-settling)."""
    kv_transfer = KVTransferConfig.from_any(
        {**fake_transfer_config(**extra), "kv_load_failure_policy": policy})
    config = make_config(block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_num_batched_tokens, kv_transfer=kv_transfer)
    connector = FakeConnector(config, KVConnectorRole.SCHEDULER, KV_SPEC)
    sched = Scheduler(config, num_blocks, 256, connector)
    runner = ConnectorRunner(FakeConnector(config, KVConnectorRole.WORKER, KV_SPEC))
    return sched, connector, runner


def step(sched: Scheduler, runner: FakeRunner,
         **kv_events: Any) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step; `kv_events` (finished_recving=..., invalid_block_ids=...) are what the
    worker-side connector reports at its end."""
    so = sched.schedule()
    return so, execute(sched, runner, so, **kv_events)


def execute(sched: Scheduler, runner: FakeRunner, so: SchedulerOutput,
            **kv_events: Any) -> list[EngineCoreOutput]:
    """The second half of a step, for tests that need the blocks scheduled before they can
    say which of them the worker reports invalid."""
    runner.kv_out = [KVConnectorOutput(**kv_events)] if kv_events else []
    return sched.update_from_output(so, runner.execute(so))


def finish(sched: Scheduler, runner: FakeRunner) -> dict[str, list[int]]:
    tokens = run_to_completion(sched, runner)
    assert sched.blocks_in_use == 0
    assert not sched.has_pending_work()
    return tokens


def prompt(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


def num_hit_tokens(sched: Scheduler, token_ids: list[int]) -> int:
    """What a new request with these tokens would get from the local prefix cache now."""
    return sched.kv_cache_manager.get_computed_blocks(make_request(token_ids))[1]


def calls(connector: FakeConnector, method: str, req_id: str) -> list[tuple[Any, ...]]:
    return [c for c in connector.calls if c[0] == method and c[1] == req_id]


def new_req_data(so: SchedulerOutput, req_id: str) -> Any:
    return next(r for r in so.scheduled_new_reqs if r.req_id == req_id)
