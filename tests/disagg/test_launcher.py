"""`kvrelay up`'s building blocks: connector plans, per-instance configs, child process control."""

from __future__ import annotations

import json
import socket
import sys
import time
from pathlib import Path

import pytest

from kvrelay.disagg.connector_plans import (
    KV_SECRET_ENV,
    kv_transfer_config,
    plan_example_connector,
    plan_nixl_connector,
)
from kvrelay.disagg.launcher import (
    ChildProcess,
    ClusterError,
    ClusterSpec,
    LocalCluster,
    check_port_free,
    connector_plan,
    serve_argv,
    stop_children,
)
from kvrelay.kv_transfer.config import KVTransferConfig


def test_example_plan_shares_one_fresh_directory_between_p_and_d(tmp_path: Path) -> None:
    plan = plan_example_connector(tmp_path)
    assert Path(plan.extra_config["shared_storage_path"]).is_dir()
    producer = kv_transfer_config("ExampleConnector", "kv_producer", "p0", 5001, plan, "127.0.0.1")
    consumer = kv_transfer_config("ExampleConnector", "kv_consumer", "d0", 5002, plan, "127.0.0.1")
    assert producer["kv_connector_extra_config"] == consumer["kv_connector_extra_config"]
    # Both parse as kvrelay's (and vLLM's) KVTransferConfig.
    p, d = KVTransferConfig.from_any(producer), KVTransferConfig.from_any(consumer)
    assert p is not None and p.is_producer and not p.is_consumer and p.kv_port == 5001
    assert d is not None and d.is_consumer and not d.is_producer and d.engine_id == "d0"


def test_nixl_plan_carries_a_fresh_cluster_secret_in_the_environment(tmp_path: Path) -> None:
    first, second = plan_nixl_connector(tmp_path), plan_nixl_connector(tmp_path)
    assert len(first.env[KV_SECRET_ENV]) == 64 and first.env[KV_SECRET_ENV] != second.env[KV_SECRET_ENV]
    assert {"backend", "lease_seconds"} <= set(first.extra_config)
    assert KV_SECRET_ENV not in json.dumps(first.extra_config)  # never on a command line


def test_spec_validates_and_splits_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown connector 'Nope'"):
        ClusterSpec(connector="Nope")
    with pytest.raises(ValueError, match="num_decode must be >= 1"):
        ClusterSpec(num_decode=0)
    monkeypatch.setattr("kvrelay.disagg.launcher.available_cores", lambda: 8)
    assert ClusterSpec(num_prefill=1, num_decode=3).threads == 2
    assert ClusterSpec(num_prefill=4, num_decode=5).threads == 1
    assert ClusterSpec(threads_per_instance=3).threads == 3


def test_serve_argv_passes_model_threads_and_kv_transfer_config() -> None:
    spec = ClusterSpec(model="/m", threads_per_instance=2, serve_args=("--max-num-seqs", "4"))
    argv = serve_argv(spec, 8123, {"kv_role": "kv_producer"})
    assert argv[:5] == [sys.executable, "-m", "kvrelay.entrypoints.cli", "serve", "/m"]
    assert argv[argv.index("--port") + 1] == "8123" and argv[argv.index("--threads") + 1] == "2"
    assert json.loads(argv[argv.index("--kv-transfer-config") + 1]) == {"kv_role": "kv_producer"}
    assert argv[-2:] == ["--max-num-seqs", "4"]


def test_prefill_and_decode_tp_reach_their_instances() -> None:
    spec = ClusterSpec(prefill_tp=2, decode_tp=1, threads_per_instance=2)
    prefill = serve_argv(spec, 8123, {"kv_role": "kv_producer"}, spec.prefill_tp)
    decode = serve_argv(spec, 8124, {"kv_role": "kv_consumer"}, spec.decode_tp)
    assert prefill[prefill.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in decode  # TP 1: serve's default
    with pytest.raises(ValueError, match="decode_tp must be >= 1"):
        ClusterSpec(decode_tp=0)


def test_a_tp_instance_gets_a_run_of_free_kv_ports() -> None:
    from kvrelay.disagg.launcher import free_port_run

    first = free_port_run("127.0.0.1", 4)
    for port in range(first, first + 4):  # every rank's side channel can bind its port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_up_cli_takes_prefill_tp_and_decode_tp() -> None:
    from kvrelay.entrypoints.cli import build_parser

    args = build_parser().parse_args(["up", "--prefill-tp", "2", "--decode-tp", "4"])
    assert (args.prefill_tp, args.decode_tp) == (2, 4)
    serve = build_parser().parse_args(["serve", "-tp", "2"])
    assert serve.tensor_parallel_size == 2
    assert build_parser().parse_args(["serve", "--tensor-parallel-size", "3"]).tensor_parallel_size == 3


def test_a_busy_port_is_a_clear_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(ClusterError, match="not free.*--port"):
            check_port_free("127.0.0.1", s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_stop_kills_a_child_that_ignores_sigterm_and_its_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = ("import signal, subprocess, sys, time\n"
              "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
              f"open({str(pid_file)!r}, 'w').write(str(g.pid))\n"
              "time.sleep(60)\n")
    child = ChildProcess("stubborn", [sys.executable, "-c", script], "http://127.0.0.1:1",
                         tmp_path / "stubborn.log")
    child.start()
    deadline = time.monotonic() + 20
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    start = time.monotonic()
    stop_children([child], grace_period=0.5)
    assert time.monotonic() - start < 10
    assert child.exit_code() is not None
    deadline = time.monotonic() + 5
    while _alive(grandchild):  # re-parented to init, which reaps it
        assert time.monotonic() < deadline, "the grandchild outlived the stop"
        time.sleep(0.05)


def test_a_child_that_fails_to_start_is_reported_with_its_log(tmp_path: Path) -> None:
    spec = ClusterSpec(model=str(tmp_path / "no-such-model"), port=0, threads_per_instance=1,
                       startup_timeout=120)
    cluster = LocalCluster(spec)
    with pytest.raises(ClusterError, match="exited with code") as info:
        cluster.start()
    assert "no-such-model" in str(info.value)  # the child's own error, from its log tail
    assert all(child.exit_code() is not None for child in cluster.children)
    assert cluster.workdir is not None and not cluster.workdir.exists()


def test_kv_backend_sets_the_nixl_connectors_transport(tmp_path: Path) -> None:
    from kvrelay.entrypoints.cli import build_parser

    assert build_parser().parse_args(["up", "--kv-backend", "mooncake"]).kv_backend == "mooncake"
    for connector in ("NixlConnector", "NixlPushConnector"):
        plan = connector_plan(ClusterSpec(connector=connector, kv_backend="mooncake"), tmp_path)
        assert plan.extra_config["backend"] == "mooncake"
    default = connector_plan(ClusterSpec(), tmp_path)
    assert default.extra_config["backend"] in ("nixl", "tcp")
    with pytest.raises(ValueError, match="ExampleConnector has none"):
        ClusterSpec(connector="ExampleConnector", kv_backend="tcp")
    with pytest.raises(SystemExit):  # argparse names the choices
        build_parser().parse_args(["up", "--kv-backend", "rdma"])
