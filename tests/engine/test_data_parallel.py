"""Data-parallel ranks: each rank's config (engine id, KV ports, KV events), and how
DataParallelLLM starts them. The front end at work (routing, the header, health, a rank's death)
is tested on a real `kvrelay serve --data-parallel-size 2`: tests/entrypoints/test_serve_data_parallel.py."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import ClassVar

import pytest

from kvrelay.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from kvrelay.disagg.routing.kv_index import KVIndex
from kvrelay.engine import data_parallel
from kvrelay.engine.async_llm import AsyncLLM
from kvrelay.engine.data_parallel import DataParallelLLM
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.kv_events.config import KVEventsConfig
from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.model.loader import LoadedModel
from tests.tiny import tiny_loaded_model

BLOCK_SIZE = 4


def group(size: int = 2, tp: int = 1, **kwargs: object) -> EngineConfig:
    return EngineConfig(model=ModelConfig(device="cpu"), cache=CacheConfig(block_size=BLOCK_SIZE),
                        parallel=ParallelConfig(tensor_parallel_size=tp, data_parallel_size=size), **kwargs)


# ---------------------------------------------------------------------- each rank's config


def test_each_rank_gets_its_engine_id_kv_port_range_and_event_endpoints() -> None:
    config = group(size=3, tp=2, kv_transfer=KVTransferConfig(kv_connector="NixlConnector", engine_id="p",
                                                             kv_port=14000),
                   kv_events=KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:5557",
                                            replay_endpoint="ipc:///tmp/kvrelay-events.replay"))
    ranks = [config.for_data_parallel_rank(r) for r in range(3)]
    assert [c.kv_transfer.engine_id for c in ranks] == ["p_dp0", "p_dp1", "p_dp2"]
    assert [c.kv_transfer.kv_port for c in ranks] == [14000, 14002, 14004]  # TP rank t at + t
    assert [c.kv_events.endpoint for c in ranks] == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert ranks[2].kv_events.replay_endpoint == "ipc:///tmp/kvrelay-events.replay_dp2"
    assert [c.parallel.data_parallel_rank for c in ranks] == [0, 1, 2]
    with pytest.raises(ValueError, match="already data-parallel rank 1"):
        ranks[1].for_data_parallel_rank(0)


def test_a_multiconnector_childs_own_port_and_engine_id_move_with_its_rank() -> None:
    children = [{"kv_connector": "NixlConnector", "kv_port": 15000, "engine_id": "child"},
                {"kv_connector": "OffloadConnector"}]
    config = group(kv_transfer=KVTransferConfig(kv_connector="MultiConnector", engine_id="d", kv_port=14000,
                                                kv_connector_extra_config={"connectors": children}))
    rank1 = config.for_data_parallel_rank(1).kv_transfer
    assert (rank1.engine_id, rank1.kv_port) == ("d_dp1", 14001)
    assert rank1.kv_connector_extra_config["connectors"] == [
        {"kv_connector": "NixlConnector", "kv_port": 15001, "engine_id": "child_dp1"},
        {"kv_connector": "OffloadConnector"}]
    assert children[0]["kv_port"] == 15000  # the group's config is left as it was


def test_an_event_port_past_65535_is_refused_naming_the_rank() -> None:
    config = group(size=3, kv_events=KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:65534"))
    assert config.for_data_parallel_rank(1).kv_events.endpoint == "tcp://*:65535"
    with pytest.raises(ValueError, match="rank 2 would publish on port 65536, past 65535"):
        config.for_data_parallel_rank(2)


def test_an_engine_refuses_the_config_of_a_whole_group() -> None:
    with pytest.raises(ValueError, match="data_parallel_size=2 describes several engines"):
        LLMEngine(group())  # refused before any model is read


# ---------------------------------------------------------------------- starting the ranks


class FakeEngine:
    """Stands in for a rank's LLMEngine: rank 1 fails to start (a taken port, say), after rank 0
    started its workers."""

    started: ClassVar[list[FakeEngine]] = []

    def __init__(self, config: EngineConfig, loaded: object, event_sink: object = None) -> None:
        if config.parallel.data_parallel_rank == 1:
            time.sleep(0.2)
            raise ValueError("cannot bind the KV side channel to tcp://127.0.0.1:14580")
        self.config, self.stopped = config, False
        FakeEngine.started.append(self)

    def shutdown(self) -> None:
        self.stopped = True


def test_a_rank_that_cannot_start_stops_the_ranks_that_did_and_says_why(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_parallel, "LLMEngine", FakeEngine)
    model = LoadedModel(spec=None, weights={}, tokenizer=None, name="fake", source="memory")  # type: ignore
    monkeypatch.setattr(data_parallel, "load_engine_model", lambda config: model)
    FakeEngine.started = []
    config = dataclasses.replace(group(), parallel=ParallelConfig(distributed_executor_backend="mp",
                                                                  data_parallel_size=2))
    threads_before = set(threading.enumerate())
    with pytest.raises(ValueError, match="cannot bind the KV side channel to tcp://127.0.0.1:14580"):
        DataParallelLLM.start(config, threads_per_rank=1)
    assert [(e.config.parallel.data_parallel_rank, e.stopped) for e in FakeEngine.started] == [(0, True)]
    assert not [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]  # keepers released


def test_ranks_run_their_workers_in_their_own_processes() -> None:
    with pytest.raises(ValueError, match="use distributed_executor_backend='mp'"):
        DataParallelLLM.start(group())


def test_a_rank_served_alone_takes_requests_named_for_it_only() -> None:
    alone = AsyncLLM(LLMEngine(group(size=3).for_data_parallel_rank(1), loaded=tiny_loaded_model()))
    plain = AsyncLLM(LLMEngine(EngineConfig(model=ModelConfig(device="cpu")), loaded=tiny_loaded_model()))
    try:
        assert (alone.dp_rank, plain.dp_rank) == (1, None)
        assert alone.pick_rank([1, 2, 3], None, 1) is alone and alone.pick_rank([1, 2, 3], None) is alone
        with pytest.raises(ValueError, match="runs data-parallel rank 1 of 3 alone"):
            alone.pick_rank([1, 2, 3], None, 2)
        assert plain.pick_rank([1, 2, 3], None, 0) is plain
        with pytest.raises(ValueError, match=r"data_parallel_rank 1 is out of range \[0, 1\)"):
            plain.pick_rank([1, 2, 3], None, 1)
    finally:
        for llm in (alone, plain):
            llm.shutdown()
            llm.engine.shutdown()


def test_a_refused_requests_remote_kv_is_released_through_a_rank_that_is_up() -> None:
    """`kvrelay serve` releases P's KV for a request it refused before any rank saw it
    (openai_server): any rank's connector can tell P, so the first one up does, none when all are down."""
    llms = [AsyncLLM(LLMEngine(group().for_data_parallel_rank(r), loaded=tiny_loaded_model()))
            for r in range(2)]
    released: list[tuple[int | None, list[int]]] = []
    for llm in llms:
        llm.release_remote_kv = (  # type: ignore[method-assign]
            lambda tokens, params, rank=llm.dp_rank: released.append((rank, tokens)))
    front = DataParallelLLM(llms, KVIndex())
    params = {"do_remote_prefill": True, "remote_engine_id": "p"}
    try:
        front.release_remote_kv([1, 2, 3], params)
        llms[0].shutdown()
        front.release_remote_kv([4, 5], params)
        llms[1].shutdown()
        front.release_remote_kv([6], params)
        assert released == [(0, [1, 2, 3]), (1, [4, 5])]
    finally:
        front.shutdown()
