"""`kvrelay up`'s building blocks: connector plans, per-instance configs, child process control."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from kvrelay.disagg import workdir
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
from tests.tiny import tiny_tokenizer


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


def failing_start(tmp_path: Path) -> tuple[LocalCluster, str]:
    """A cluster whose instances cannot load their model, started: (it, the start's error)."""
    cluster = LocalCluster(ClusterSpec(model=str(tmp_path / "no-such-model"), port=0, threads_per_instance=1,
                                       startup_timeout=120))
    with pytest.raises(ClusterError, match="exited with code") as info:
        cluster.start()
    return cluster, str(info.value)


def test_a_child_that_fails_to_start_is_reported_with_its_log_which_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cluster, error = failing_start(tmp_path)
    assert "no-such-model" in error  # the child's own error, from its log tail
    assert all(child.exit_code() is not None for child in cluster.children)
    assert cluster.workdir is not None and not cluster.workdir.exists()
    kept = re.search(r"the logs of this start are kept in (\S+)/ \((.*)\)", error)
    assert kept, error
    assert set(kept.group(2).split(", ")) == {"prefill-0.log", "decode-0.log"}
    assert "no-such-model" in (Path(kept.group(1)) / "prefill-0.log").read_text()
    assert not Path(kept.group(1)).name.startswith(workdir.PREFIX)  # no later start removes them


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_directory_of_a_launcher_killed_with_sigkill_goes_at_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A launcher that made its directory as LocalCluster.start does, then was killed outright.
    launcher = subprocess.Popen([sys.executable, "-c", "import time\nfrom kvrelay.disagg.workdir import "
                                 "make_workdir\nmake_workdir()\ntime.sleep(120)"],
                                env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(f"{workdir.PREFIX}*/{workdir.OWNER_FILE}")):
            assert time.monotonic() < deadline and launcher.poll() is None
            time.sleep(0.05)
    finally:
        launcher.kill()
        launcher.wait()
    (left,) = tmp_path.glob(f"{workdir.PREFIX}*")
    assert (left / workdir.OWNER_FILE).read_text().split()[0] == str(launcher.pid)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = workdir.make_workdir()  # the directory of a launcher that still runs (this one) stays
    cluster, _ = failing_start(tmp_path)  # the next start, even one that fails, removes the stale one
    assert not left.exists() and mine.exists()
    assert cluster.workdir is not None and cluster.workdir.parent == tmp_path  # made by make_workdir
    shutil.rmtree(mine)


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


def test_the_banner_shows_connector_transport_offload_tiers_and_routing() -> None:
    from kvrelay.disagg.launcher_cli import banner

    spec = ClusterSpec(connector="NixlPushConnector", kv_backend="mooncake", device="cpu",
                       offload={"cpu_bytes": "2GiB", "disk_dir": "/var/kv", "remote_url": "redis://h:6379/0"},
                       prefill_routing="round-robin", decode_routing="kv-aware", num_decode=2)
    lines = banner(LocalCluster(spec))
    text = "\n".join(lines)
    assert "connector    NixlPushConnector (push: P writes each layer into D's blocks while it computes), " \
           "transport mooncake" in text
    assert "offload      decode instances run MultiConnector(P/D connector, OffloadConnector: cpu 2GiB, " \
           "disk /var/kv (default size), remote redis://h:6379/0)" in text
    assert "routing      prefill round-robin, decode kv-aware" in text
    assert [line.split()[0] for line in lines[-3:]] == ["prefill-0", "decode-0", "decode-1"]
    plain = "\n".join(banner(LocalCluster(ClusterSpec(connector="ExampleConnector", device="cpu"))))
    assert "ExampleConnector (P writes each prompt's KV to a shared directory" in plain
    assert "transport" not in plain and "offload      off" in plain


def test_up_passes_its_chat_template_to_the_instances_and_to_the_kv_aware_proxy(tmp_path: Path) -> None:
    from kvrelay.disagg.proxy_cli import _tokenizer_with_template
    from kvrelay.entrypoints.cli import build_parser

    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}t9 {{ m['content'] }} {% endfor %}t8")
    args = build_parser().parse_args(["up", "--chat-template", str(template), "--device", "cpu"])
    assert args.chat_template == str(template)
    spec = ClusterSpec(model="/m", device="cpu", chat_template=str(template),
                       serve_args=("--chat-template", str(template)))
    argv = LocalCluster(spec).proxy_argv(["http://p"], ["http://d"], None)
    assert argv[argv.index("--chat-template") + 1] == str(template)
    assert argv[argv.index("--model") + 1] == "/m"
    by_load = LocalCluster(dataclasses.replace(spec, prefill_routing="round-robin",
                                               decode_routing="round-robin"))
    assert "--chat-template" not in by_load.proxy_argv(["http://p"], ["http://d"], None)
    tiny_tokenizer().save(tmp_path / "model")  # the proxy reads a model's tokenizer only
    tokenizer = _tokenizer_with_template(str(tmp_path / "model"), str(template))
    assert tokenizer.apply_chat_template([{"role": "user", "content": "t5"}]) == "t9 t5 t8"
