"""A local P/D cluster in one command: prefill and decode `kvrelay serve` processes plus the proxy.

    with LocalCluster(ClusterSpec(model=None, port=8000)) as cluster:
        print(cluster.url)          # the proxy: an OpenAI-compatible endpoint
        cluster.wait_for_exit()     # until a child dies (Ctrl-C lands here as KeyboardInterrupt)

Every child runs in its own session (process group), so stopping one stops whatever it spawned:
SIGTERM to the group, SIGKILL after a grace period. Children die with the launcher even when it
is killed outright (Linux: PR_SET_PDEATHSIG), and `stop()` also runs from atexit.

Which KV connector links P and D is one small plan per connector (connector_plans.py): it
returns the connector's `kv_connector_extra_config` and any environment the children need. Where
each instance runs (the CPU, or which GPUs and what share of their memory) is placement.py's,
decided when the LocalCluster is built, before anything starts.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrelay.disagg.children import ChildProcess, ClusterError, stop_children, wait_healthy
from kvrelay.disagg.connector_plans import (
    CONNECTOR_PLANS,
    DEFAULT_CONNECTOR,
    ConnectorPlan,
    kv_transfer_config,
    transfer_path,
    with_transfer_path,
)
from kvrelay.disagg.placement import Placement, plan_devices, startup_waves, visible_gpus
from kvrelay.disagg.routing.policies import DEFAULT_POLICY
from kvrelay.disagg.workdir import keep_logs as move_logs
from kvrelay.disagg.workdir import make_workdir
from kvrelay.utils import busy_port_error

if TYPE_CHECKING:
    from kvrelay.kv_transfer.path_choice import PathChoice

KV_ADMIN_ENV = "KVRELAY_ADMIN_KEY"
API_KEY_ENV = "KVRELAY_API_KEY"


def connector_plan(spec: ClusterSpec, workdir: Path, path: PathChoice | None = None) -> ConnectorPlan:
    """The cluster's connector plan: on GPUs the transfer `path` chosen for its placements, else
    `spec.kv_backend` as the transport where one is chosen."""
    plan = CONNECTOR_PLANS[spec.connector](workdir)
    if path is not None:
        return with_transfer_path(plan, path)
    if spec.kv_backend is None:
        return plan
    return dataclasses.replace(plan, extra_config={**plan.extra_config, "backend": spec.kv_backend})


# ---------------------------------------------------------------------- the cluster


@dataclass(frozen=True)
class ClusterSpec:
    model: str | None = None  # None: serve's default model
    host: str = "127.0.0.1"
    port: int = 8000  # the proxy's port; 0 picks a free one
    connector: str = DEFAULT_CONNECTOR
    num_prefill: int = 1
    num_decode: int = 1
    threads_per_instance: int | None = None  # None: the machine's cores split evenly
    serve_args: tuple[str, ...] = ()  # extra flags for every `kvrelay serve`
    startup_timeout: float = 600.0
    grace_period: float = 10.0
    log_dir: str | None = None  # None: inside the cluster's temp directory (kept only on failure)
    # OffloadConnector extra config for the decode instances (None: no offload tiers).
    offload: dict[str, Any] | None = None
    prefill_tp: int = 1  # tensor_parallel_size of each prefill instance
    decode_tp: int = 1  # tensor_parallel_size of each decode instance
    prefill_dp: int = 1  # data_parallel_size of each prefill instance: ranks behind its one URL
    decode_dp: int = 1
    kv_backend: str | None = None  # the Nixl connectors' transport (None: the plan's default)
    # Where the instances run (placement.py): auto (the GPUs when there are any), cpu, cuda or
    # cuda:N; on GPUs `gpu_memory_utilization` is split between instances that share one.
    device: str = "auto"
    gpu_memory_utilization: float = 0.9
    prefill_routing: str = DEFAULT_POLICY  # the proxy's policies (kvrelay.disagg.routing)
    decode_routing: str = DEFAULT_POLICY
    # The proxy's admin API key (None: off); `kvrelay up --admin` makes one.
    admin_key: str | None = field(default=None, repr=False)
    # The key clients must send (as to `kvrelay serve --api-key`): the proxy and every instance
    # require it, given to them in the environment (KVRELAY_API_KEY), never in argv.
    api_key: str | None = field(default=None, repr=False)
    chat_template: str | None = None  # --chat-template as given (also in serve_args): the proxy's too

    def __post_init__(self) -> None:
        if self.connector not in CONNECTOR_PLANS:
            raise ValueError(f"unknown connector {self.connector!r} for `kvrelay up`; "
                             f"known: {', '.join(CONNECTOR_PLANS)}")
        if self.kv_backend is not None and self.connector not in ("NixlConnector", "NixlPushConnector"):
            raise ValueError(f"kv_backend={self.kv_backend!r} chooses the transport of NixlConnector and "
                             f"NixlPushConnector; {self.connector} has none")
        if self.prefill_dp > 1 and self.connector == "NixlPushConnector":
            raise ValueError("NixlPushConnector: D registers with P's side channel before P picks a "
                             "data-parallel rank, so --prefill-dp must be 1 in push mode "
                             "(--decode-dp may be more)")
        for name in ("num_prefill", "num_decode", "prefill_tp", "decode_tp", "prefill_dp", "decode_dp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.threads_per_instance is not None and self.threads_per_instance < 1:
            raise ValueError(f"threads_per_instance must be >= 1, got {self.threads_per_instance}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def instances(self) -> list[tuple[str, int]]:
        """(name, ranks: tensor- times data-parallel size) of every serve child, prefill first."""
        return ([(f"prefill-{i}", self.prefill_tp * self.prefill_dp) for i in range(self.num_prefill)]
                + [(f"decode-{i}", self.decode_tp * self.decode_dp) for i in range(self.num_decode)])

    @property
    def threads(self) -> int:
        """Torch threads of each engine (each data-parallel rank of an instance has this many)."""
        if self.threads_per_instance is not None:
            return self.threads_per_instance
        engines = self.num_prefill * self.prefill_dp + self.num_decode * self.decode_dp
        return max(1, available_cores() // engines)


def place_instances(spec: ClusterSpec) -> list[Placement]:
    """Where each of the spec's instances runs on this machine (placement.py); ValueError when it
    cannot run them as asked."""
    gpus = [] if spec.device.strip().lower() == "cpu" else visible_gpus()
    return plan_devices(gpus, spec.instances, spec.device, spec.gpu_memory_utilization)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def free_port_run(host: str, count: int, attempts: int = 50) -> int:
    """A port p with p .. p + count - 1 all free now (a TP instance's ranks listen on kv_port + rank)."""
    for _ in range(attempts):
        first = free_port(host)
        if first + count - 1 > 65535:
            continue
        try:
            for port in range(first + 1, first + count):
                check_port_free(host, port)
        except ClusterError:
            continue
        return first
    raise ClusterError(f"found no {count} consecutive free ports on {host} in {attempts} tries")


def check_port_free(host: str, port: int) -> None:
    problem = busy_port_error(host, port)
    if problem is not None:
        raise ClusterError(problem)


def serve_argv(spec: ClusterSpec, port: int, transfer_config: dict[str, Any],
               tensor_parallel_size: int = 1, device_args: tuple[str, ...] = (),
               events_config: dict[str, Any] | None = None, data_parallel_size: int = 1) -> list[str]:
    """One instance's `kvrelay serve` command line; `device_args`: its Placement's flags."""
    argv = [sys.executable, "-m", "kvrelay.entrypoints.cli", "serve"]
    if spec.model:
        argv.append(spec.model)
    argv += ["--host", spec.host, "--port", str(port), "--threads", str(spec.threads),
             "--kv-transfer-config", json.dumps(transfer_config), *spec.serve_args]
    if events_config is not None:
        argv += ["--kv-events-config", json.dumps(events_config)]
    if tensor_parallel_size != 1:
        argv += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if data_parallel_size != 1:
        argv += ["--data-parallel-size", str(data_parallel_size)]
    return argv + list(device_args)


def kv_events_config(events_dir: Path, name: str) -> dict[str, Any]:
    """One instance's --kv-events-config: PUB and replay sockets on ipc:// paths in the cluster's
    directory (local by construction), which the proxy finds through the instance's /kv_events."""
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{events_dir}/{name}.pub",
            "replay_endpoint": f"ipc://{events_dir}/{name}.replay", "topic": "kv-events"}


@contextlib.contextmanager
def single_instance(model: str | None, threads: int, serve_args: tuple[str, ...] = (),
                    startup_timeout: float = 600.0, grace_period: float = 10.0) -> Iterator[ChildProcess]:
    """One plain `kvrelay serve` (no connector) on a free loopback port, healthy while the
    block runs and stopped after it: the baseline the P/D benchmarks compare against."""
    port = free_port()
    argv = [sys.executable, "-m", "kvrelay.entrypoints.cli", "serve", *([model] if model else []),
            "--port", str(port), "--threads", str(threads), *serve_args]
    with tempfile.TemporaryDirectory(prefix="kvrelay-single-") as tmp:
        child = ChildProcess("single", argv, f"http://127.0.0.1:{port}", Path(tmp) / "serve.log",
                             env={"OMP_NUM_THREADS": str(threads)})
        child.start()
        try:
            wait_healthy([child], startup_timeout)
            yield child
        finally:
            stop_children([child], grace_period)


class LocalCluster:
    """P and D serve processes and the proxy, started in that order, stopped together."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.placements = place_instances(spec)  # ValueError here, before anything starts
        # NOTE: on GPUs, how KV moves between instances follows from where they run.
        self.transfer_path = transfer_path(spec.connector, [p.gpus for p in self.placements], spec.kv_backend)
        self.children: list[ChildProcess] = []
        self.workdir: Path | None = None
        self.port = spec.port
        self.kv_addresses: dict[str, str] = {}  # child name -> "kv_ip:kv_port"
        self._stopped = False
        self._plan: ConnectorPlan | None = None
        self._log_dir: Path | None = None
        self._counts = {"prefill": 0, "decode": 0}  # instances ever started, for their names
        self._lock = threading.Lock()  # children change while `kvrelay up --admin` runs

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def prefill(self) -> list[ChildProcess]:
        return [c for c in list(self.children) if c.name.startswith("prefill")]

    @property
    def decode(self) -> list[ChildProcess]:
        return [c for c in list(self.children) if c.name.startswith("decode")]

    @property
    def proxy(self) -> ChildProcess | None:
        return next((c for c in list(self.children) if c.name == "proxy"), None)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        atexit.register(self.stop)
        try:
            self._start()
        except ClusterError as e:  # a failed start leaves no process behind, and keeps its logs
            kept = self.stop(keep_logs=True)
            raise ClusterError(f"{e}\n{_logs_note(kept)}") from None
        except BaseException:  # an interrupted one leaves nothing behind
            self.stop()
            raise

    def _start(self) -> None:
        spec = self.spec
        if self.port == 0:
            self.port = free_port(spec.host)
        check_port_free(spec.host, self.port)
        self.workdir = make_workdir()  # and the directories of launchers that were killed go
        self._log_dir = Path(spec.log_dir) if spec.log_dir else self.workdir / "logs"
        (self.workdir / "events").mkdir()
        self._plan = plan = connector_plan(spec, self.workdir, self.transfer_path)
        instances = {p.name: self._instance(p, plan, self._log_dir) for p in self.placements}
        self._counts = {"prefill": spec.num_prefill, "decode": spec.num_decode}
        self.children.extend(instances.values())
        for wave in startup_waves(self.placements):  # on the CPU: one wave, everything at once
            starting = [instances[p.name] for p in wave]
            for child in starting:
                child.start()
            self._wait_healthy(starting)
        # NOTE: the admin key travels in the environment, never in argv (ps shows argv).
        env = {**self._api_key_env(), **({KV_ADMIN_ENV: spec.admin_key} if spec.admin_key else {})}
        push_to = [self.kv_addresses[c.name] for c in self.prefill] if plan.transfer_mode == "push" else None
        argv = self.proxy_argv([c.url for c in self.prefill], [c.url for c in self.decode], push_to)
        proxy = ChildProcess("proxy", argv, self.url, self._log_dir / "proxy.log", env)
        self.children.append(proxy)
        proxy.start()
        self._wait_healthy([proxy])

    def proxy_argv(self, prefill: list[str], decode: list[str], push_to: list[str] | None) -> list[str]:
        """The proxy's `kvrelay proxy` command line; `push_to`: push mode, P's side channels."""
        spec = self.spec
        argv = [sys.executable, "-m", "kvrelay.entrypoints.cli", "proxy", "--host", spec.host,
                "--port", str(self.port), "--prefill", *prefill, "--decode", *decode,
                "--prefill-routing", spec.prefill_routing, "--decode-routing", spec.decode_routing]
        if "kv-aware" in (spec.prefill_routing, spec.decode_routing):  # its tokenizer hashes prompts
            argv += ["--model", spec.model] if spec.model else []
            argv += ["--chat-template", spec.chat_template] if spec.chat_template else []
        if push_to is not None:
            argv += ["--transfer-mode", "push", "--prefill-kv", *push_to]
        return argv

    def _instance(self, placement: Placement, plan: ConnectorPlan, log_dir: Path) -> ChildProcess:
        """One `kvrelay serve` child: its own HTTP port, kv_port, engine id, device and (once the
        cluster has its directory) KV event sockets."""
        spec, name = self.spec, placement.name
        port = free_port(spec.host)
        engine_id = f"kvrelay-{name}-{uuid.uuid4().hex[:8]}"
        kv_role = "kv_producer" if name.startswith("prefill") else "kv_consumer"
        offload = spec.offload if kv_role == "kv_consumer" else None
        prefill = kv_role == "kv_producer"
        tp, dp = (spec.prefill_tp, spec.prefill_dp) if prefill else (spec.decode_tp, spec.decode_dp)
        kv_port = free_port_run(spec.host, tp * dp)  # dp rank d, tp rank t listens on kv_port + d * tp + t
        self.kv_addresses[name] = f"{spec.host}:{kv_port}"
        config = kv_transfer_config(spec.connector, kv_role, engine_id, kv_port, plan, spec.host, offload)
        env = {**plan.env, "OMP_NUM_THREADS": str(spec.threads), **placement.env, **self._api_key_env()}
        events = kv_events_config(self.workdir / "events", name) if self.workdir is not None else None
        argv = serve_argv(spec, port, config, tp, placement.serve_args, events, dp)
        return ChildProcess(name, argv, f"http://{spec.host}:{port}", log_dir / f"{name}.log", env)

    def _api_key_env(self) -> dict[str, str]:
        return {API_KEY_ENV: self.spec.api_key} if self.spec.api_key else {}

    def start_instance(self, role: str) -> ChildProcess:
        """Start one more prefill or decode instance and wait until it is healthy (the caller
        then adds it to the proxy's pool). ClusterError, with its log, if it does not start.
        NOTE: call it from a thread that lives as long as the cluster: the child gets SIGTERM
        when the thread that started it ends (PR_SET_PDEATHSIG follows the thread)."""
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        if any(p.gpus for p in self.placements):
            raise ClusterError("instances run on GPUs, whose memory the starting ones already share: "
                               "start the cluster with every instance it needs")
        with self._lock:
            name = f"{role}-{self._counts[role]}"
            self._counts[role] += 1
            assert self._plan is not None and self._log_dir is not None, "start() the cluster first"
            placement = Placement(name, self.placements[0].device if self.placements else None)
            child = self._instance(placement, self._plan, self._log_dir)
            self.children.append(child)
        child.start()
        try:
            self._wait_healthy([child])
        except ClusterError:
            self.stop_instance(child)
            raise
        return child

    def stop_instance(self, child: ChildProcess) -> None:
        """Stop one instance (drained from the proxy's pool first) and forget it."""
        with self._lock:
            if child in self.children:
                self.children.remove(child)
        stop_children([child], self.spec.grace_period)

    def find(self, url: str) -> ChildProcess | None:
        return next((c for c in list(self.children) if c.url == url.rstrip("/")), None)

    def _wait_healthy(self, children: list[ChildProcess]) -> None:
        wait_healthy(children, self.spec.startup_timeout)

    def wait_for_exit(self, poll_interval: float = 0.5, instances_may_exit: bool = False) -> ChildProcess:
        """Block until some child exits; returns it (the caller then stops the rest). With
        `instances_may_exit` (a pool the proxy manages), an instance that exits is reported and
        forgotten, the proxy's health checks route around it, and only the proxy's exit returns."""
        while True:
            for child in list(self.children):
                if child.exit_code() is None:
                    continue
                if not instances_may_exit or child.name == "proxy":
                    return child
                print(f"kvrelay up: {child.name} ({child.url}) exited with code {child.exit_code()}; the "
                      f"proxy routes around it. Last lines of its log:\n{child.log_tail()}", file=sys.stderr,
                      flush=True)
                self.stop_instance(child)
            time.sleep(poll_interval)

    def stop(self, keep_logs: bool = False) -> Path | None:
        """Stop every child and remove the temp directory. Idempotent. `keep_logs` (a failure):
        the children's logs are kept; where they are (None: nowhere)."""
        if self._stopped:
            return None
        self._stopped = True
        atexit.unregister(self.stop)
        # NOTE: a second Ctrl-C (or SIGTERM) must not interrupt the stop and strand children.
        signals = (signal.SIGINT, signal.SIGTERM) if _in_main_thread() else ()
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in signals}
        try:
            stop_children(self.children, self.spec.grace_period)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            kept = self._log_dir if self.spec.log_dir else None
            if keep_logs and kept is None and self._log_dir is not None:
                kept = move_logs(self._log_dir)
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return kept


def _logs_note(kept: Path | None) -> str:
    if kept is None:
        return "(no instance wrote a log)"
    names = ", ".join(sorted(p.name for p in kept.glob("*.log")))
    return f"the logs of this start are kept in {kept}/ ({names})"


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
