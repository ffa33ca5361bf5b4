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
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

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

if TYPE_CHECKING:
    from kvrelay.kv_transfer.path_choice import PathChoice

KV_ADMIN_ENV = "KVRELAY_ADMIN_KEY"


class ClusterError(RuntimeError):
    """A child failed to start, did not become healthy, or died."""


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
    log_dir: str | None = None  # None: inside the cluster's temp directory (removed at exit)
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
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            raise ClusterError(f"port {port} on {host} is not free ({e.strerror}); "
                               "pass another --port (0 picks a free one)") from None


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, however it dies."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


class ChildProcess:
    """One child in its own process group, logging to a file, with a health URL."""

    def __init__(self, name: str, argv: list[str], url: str, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.url, self.log_path = name, argv, url, log_path
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, preexec_fn=_die_with_parent)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def exit_code(self) -> int | None:
        """None while running (or never started)."""
        return self.process.poll() if self.process is not None else None

    def is_healthy(self, timeout: float = 2.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, num_lines: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-num_lines:]) or "(empty log)"

    def signal_group(self, sig: int) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, sig)  # the child's pid is its group id (own session)
        except (ProcessLookupError, PermissionError):
            pass


def stop_children(children: list[ChildProcess], grace_period: float) -> None:
    """SIGTERM every child's group, wait up to `grace_period`, then SIGKILL what is left."""
    for child in children:
        if child.exit_code() is None:
            child.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for child in children:
        child.signal_group(signal.SIGKILL)  # the leader if hung, and any straggler in its group
        if child.process is not None:
            child.process.wait()


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


def wait_healthy(children: list[ChildProcess], timeout_s: float) -> None:
    """Block until every child answers /health; ClusterError (with its log) if one exits first
    or the time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(children)
    while pending:
        for child in list(pending):
            code = child.exit_code()
            if code is not None:
                raise ClusterError(f"{child.name} exited with code {code} while starting; "
                                   f"last lines of {child.log_path}:\n{child.log_tail()}")
            if child.is_healthy():
                pending.remove(child)
        if pending and time.monotonic() > deadline:
            tails = "\n".join(f"--- {c.name} ({c.log_path}):\n{c.log_tail()}" for c in pending)
            raise ClusterError(f"not healthy after {timeout_s:.0f} s: "
                               f"{', '.join(c.name for c in pending)}\n{tails}")
        if pending:
            time.sleep(0.25)


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
        except BaseException:  # a failed or interrupted start leaves nothing behind
            self.stop()
            raise

    def _start(self) -> None:
        spec = self.spec
        if self.port == 0:
            self.port = free_port(spec.host)
        check_port_free(spec.host, self.port)
        self.workdir = Path(tempfile.mkdtemp(prefix="kvrelay-up-"))
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
        proxy_argv = [sys.executable, "-m", "kvrelay.entrypoints.cli", "proxy",
                      "--host", spec.host, "--port", str(self.port),
                      "--prefill", *(c.url for c in self.prefill), "--decode", *(c.url for c in self.decode),
                      "--prefill-routing", spec.prefill_routing, "--decode-routing", spec.decode_routing]
        if spec.model and "kv-aware" in (spec.prefill_routing, spec.decode_routing):
            proxy_argv += ["--model", spec.model]  # its tokenizer hashes prompts
        if plan.transfer_mode == "push":
            proxy_argv += ["--transfer-mode", "push",
                           "--prefill-kv", *(self.kv_addresses[c.name] for c in self.prefill)]
        # NOTE: the admin key travels in the environment, never in argv (ps shows argv).
        env = {KV_ADMIN_ENV: spec.admin_key} if spec.admin_key else {}
        proxy = ChildProcess("proxy", proxy_argv, self.url, self._log_dir / "proxy.log", env)
        self.children.append(proxy)
        proxy.start()
        self._wait_healthy([proxy])

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
        env = {**plan.env, "OMP_NUM_THREADS": str(spec.threads), **placement.env}
        events = kv_events_config(self.workdir / "events", name) if self.workdir is not None else None
        argv = serve_argv(spec, port, config, tp, placement.serve_args, events, dp)
        return ChildProcess(name, argv, f"http://{spec.host}:{port}", log_dir / f"{name}.log", env)

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

    def stop(self) -> None:
        """Stop every child and remove the temp directory. Idempotent."""
        if self._stopped:
            return
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
            if self.workdir is not None:
                shutil.rmtree(self.workdir, ignore_errors=True)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
