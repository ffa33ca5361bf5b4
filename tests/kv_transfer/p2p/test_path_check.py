"""The start-up transfer-path check: a loopback transfer on the KV device through the configured
backend, one log line with its GB/s, a gauge, and for GPU KV on a path that is not a CUDA one a
warning naming the cause, or a refusal with require_device_path."""

from __future__ import annotations

import logging

import pytest

from kvrelay.core.stats import SchedulerStats
from kvrelay.kv_transfer.config import KVTransferConfig
from kvrelay.kv_transfer.p2p.path_check import check_transfer_path, startup_stats
from kvrelay.kv_transfer.p2p.settings import NixlConfig
from kvrelay.kv_transfer.transport import ucx_diag
from kvrelay.kv_transfer.transport.loopback import data_path, measure_loopback
from kvrelay.kv_transfer.transport.ucx_diag import UcxFacts
from kvrelay.metrics.prometheus import EngineStatsCollector
from tests.kv_transfer.p2p.pd import greedy, make_engine, nixl_config, shutdown
from tests.kv_transfer.transport.helpers import new_transport

pytestmark = pytest.mark.timeout(120)


def settings(**extra) -> NixlConfig:
    return NixlConfig.from_extra_config({"backend": "tcp", **extra})


def test_the_check_logs_one_line_with_the_path_and_its_gb_per_s(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="kvrelay.kv_transfer.p2p.path_check"):
        result = check_transfer_path(settings(loopback_check_bytes="2MiB"), KVTransferConfig(), None, "cpu")
    assert result is not None and result.path.name == "host" and result.num_bytes == 2 << 20
    assert result.gbps > 0
    lines = [r.getMessage() for r in caplog.records if "KV transfer path" in r.getMessage()]
    assert len(lines) == 1 and "backend tcp on cpu took path host" in lines[0] and "GB/s" in lines[0]


@pytest.mark.parametrize("backend", ["tcp", "cuda_ipc"])
def test_the_loopback_moves_every_byte_through_the_backend(backend) -> None:
    result = measure_loopback(backend, "cpu", lambda name: new_transport(backend, name), 3 << 20)
    assert result.num_bytes == 3 << 20 and result.seconds > 0 and result.on_device_path


def test_a_failing_check_warns_and_the_instance_still_starts(caplog, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no route")

    monkeypatch.setattr("kvrelay.kv_transfer.p2p.path_check.measure_loopback", broken)
    with caplog.at_level(logging.WARNING):
        assert check_transfer_path(settings(), KVTransferConfig(), None, "cpu") is None
    assert "loopback check on cpu failed: no route" in caplog.text


def without_cuda_transports(monkeypatch) -> None:
    error = "libcuda.so.1: cannot open shared object file"
    facts = UcxFacts("/opt/ucx/lib/ucx", ("libuct_cuda.so.0",), error, None)
    monkeypatch.setattr(ucx_diag, "ucx_facts", lambda: facts)


def test_gpu_kv_on_nixl_without_ucx_cuda_warns_naming_the_cause_and_the_fix(caplog, monkeypatch) -> None:
    without_cuda_transports(monkeypatch)
    with caplog.at_level(logging.WARNING):
        check_transfer_path(settings(backend="nixl", loopback_check_bytes=0), KVTransferConfig(), None,
                            "cuda:0")
    assert "path 'ucx-host'" in caplog.text and "libcuda.so.1" in caplog.text
    assert "require_device_path" in caplog.text


def test_require_device_path_refuses_gpu_kv_on_a_host_path(monkeypatch) -> None:
    without_cuda_transports(monkeypatch)
    with pytest.raises(ValueError, match="ucx-host.*libcuda.so.1.*refuses to start"):
        check_transfer_path(settings(backend="nixl", loopback_check_bytes=0, require_device_path=True),
                            KVTransferConfig(), None, "cuda:0")
    with pytest.raises(ValueError, match="'host-staged'.*moves host memory only"):
        check_transfer_path(settings(loopback_check_bytes=0, require_device_path=True), KVTransferConfig(),
                            None, "cuda:0")


def test_device_paths_pass_the_switch(monkeypatch) -> None:
    monkeypatch.setattr(ucx_diag, "ucx_facts", lambda: UcxFacts("/x", ("libuct_cuda.so",), None, None))
    for backend in ("cuda_ipc", "nixl"):
        check_transfer_path(settings(backend=backend, loopback_check_bytes=0, require_device_path=True),
                            KVTransferConfig(), None, "cuda:0")
    assert data_path("nixl", "cuda:0").name == "ucx-cuda" and data_path("tcp", "cpu").name == "host"


@pytest.mark.parametrize("tls, excluded", [(None, False), ("tcp", True), ("tcp,cuda_copy", False),
                                           ("^cuda_ipc", True), ("^tcp", False), ("all", False)])
def test_ucx_tls_that_leaves_out_cuda_is_named(tls, excluded) -> None:
    facts = UcxFacts("/x", ("libuct_cuda.so",), None, tls)
    assert facts.tls_excludes_cuda is excluded and facts.cuda_transports is not excluded
    if excluded:
        assert "UCX_TLS" in facts.cause()


def test_the_figure_becomes_a_gauge_of_the_slowest_rank() -> None:
    stats = SchedulerStats()
    stats.absorb_connector_stats({"loopback_gbps:nixl:ucx-cuda:0": 300.0,
                                  "loopback_gbps:nixl:ucx-cuda:1": 250.0})
    assert stats.as_dict()["kv_transfer_loopback_gbps"] == {"nixl:ucx-cuda": 250.0}
    metrics = {m.name: m for m in EngineStatsCollector(stats.as_dict).collect()}
    sample = metrics["kvrelay_kv_transfer_loopback_gbps"].samples[0]
    assert sample.labels == {"backend": "nixl", "path": "ucx-cuda"} and sample.value == 250.0


def test_an_engine_reports_its_loopback_figure_after_its_first_step() -> None:
    engine = make_engine(nixl_config("kv_producer", backend="tcp", loopback_check_bytes="1MiB"))
    try:
        engine.add_request({"prompt_token_ids": [1, 2, 3]}, greedy(1), request_id="r")
        while engine.has_unfinished_requests():
            engine.step()
        figures = engine.get_stats()["kv_transfer_loopback_gbps"]
        assert list(figures) == ["tcp:host"] and figures["tcp:host"] > 0
    finally:
        shutdown(engine)


def test_startup_stats_are_empty_without_a_measurement() -> None:
    assert startup_stats(settings(loopback_check_bytes=0), KVTransferConfig(), None, "cpu", 0) == {}
