"""`kvrelay serve [MODEL]`: one instance behind an OpenAI-compatible HTTP API.

Heavy imports (torch, fastapi, uvicorn) happen inside the command, so `kvrelay --help` stays fast.
SIGTERM and SIGINT stop the server gracefully: open connections get a few seconds, then the
engine thread is stopped and joined, and the process exits with status 0. If the engine dies
(a worker process of a tensor-parallel instance died or hung), requests in flight fail, /health
answers 503, the server stops and the process exits with status 1.

With --data-parallel-size N the server fronts N ranks, each a whole engine in its own worker
processes (kvrelay.engine.data_parallel). A rank that dies fails its own requests and leaves the
routing, /health names it (still 200 while another rank serves), and the server stops only when
every rank is down; it exits with status 1 if any rank died.

An idle HTTP keep-alive connection is closed after --timeout-keep-alive seconds (5: uvicorn's
default, and vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE); a proxy in front must drop idle connections
sooner (`kvrelay proxy --keepalive-expiry`, 2 by default).
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Callable
from typing import Any

from kvrelay.config import EngineConfig
from kvrelay.entrypoints.engine_args import EngineArgs, add_engine_args
from kvrelay.utils import HTTP_KEEP_ALIVE_S, busy_port_error

logger = logging.getLogger("kvrelay.serve")

_GRACEFUL_SHUTDOWN_S = 5
KEEP_ALIVE_S = HTTP_KEEP_ALIVE_S


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                        "(default: env KVRELAY_API_KEY)")
    p.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S, metavar="SECONDS",
                   help=f"close an idle keep-alive connection after this many seconds (default "
                        f"{KEEP_ALIVE_S}, as uvicorn and vLLM); a proxy in front must drop idle "
                        "connections sooner")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    add_engine_args(p, "serve")
    p.set_defaults(func=cmd_serve)


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """The instance's EngineConfig from `serve`'s flags; ValueError naming a bad flag."""
    return EngineArgs.from_cli_args(args).create_engine_config()


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.timeout_keep_alive < 1:
        raise ValueError(f"--timeout-keep-alive must be at least 1 second, got {args.timeout_keep_alive}")
    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config()  # bad flags fail here, before the model loads
    busy = busy_port_error(args.host, args.port)  # and a busy port, as `kvrelay up` checks its own
    if busy is not None:
        raise ValueError(busy)
    engine_args.set_torch_threads()

    from kvrelay import env
    from kvrelay.entrypoints.openai_server import build_app

    async_llm, stop_engines = _start_engines(config, engine_args.threads)
    try:
        app = build_app(async_llm, async_llm.model_name, args.api_key or env.api_key())
        _run_uvicorn(app, args, async_llm.model_name, async_llm)
    finally:
        stop_engines()
        others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        if others:
            logger.warning("threads still running at exit: %s", ", ".join(others))
    if async_llm.crashed:
        logger.error("kvrelay serve stopped: %s", _dead_ranks(async_llm))
        return 1
    logger.info("kvrelay serve stopped")
    return 0


def _start_engines(config: EngineConfig, threads: int | None) -> tuple[Any, Callable[[], None]]:
    """The engine client `serve` fronts (one engine, or a data-parallel group's ranks, each a
    whole engine in its own worker processes) and how to stop it."""
    if config.parallel.is_data_parallel_group:
        from kvrelay.engine.data_parallel import DataParallelLLM

        group = DataParallelLLM.start(config, threads)
        return group, group.shutdown

    from kvrelay.engine.async_llm import AsyncLLM
    from kvrelay.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    async_llm = AsyncLLM(engine)

    def stop() -> None:
        async_llm.shutdown()
        engine.shutdown()  # NOTE: after a crash the engine thread did not: stop the workers here
    return async_llm, stop


def _dead_ranks(client: Any) -> str:
    """Why the engines that crashed did (each data-parallel rank named)."""
    return "; ".join(llm.dead_reason if llm.dp_rank is None else f"data-parallel rank {llm.dp_rank}: "
                     f"{llm.dead_reason}" for llm in client.ranks if llm.crashed)


def uvicorn_config(app: Any, args: argparse.Namespace) -> Any:
    """The HTTP server's settings from `serve`'s flags (a uvicorn.Config)."""
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                          access_log=args.log_level == "debug", timeout_keep_alive=args.timeout_keep_alive,
                          timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S)


def _run_uvicorn(app: Any, args: argparse.Namespace, model_name: str, async_llm: Any) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                logger.info("kvrelay serve ready: http://%s:%d (model %r)", host, port, model_name)

    config = uvicorn_config(app, args)
    # uvicorn re-raises the signal it caught once it has stopped; with these handlers in place
    # that re-raise is a no-op, so the engine shutdown in the caller still runs.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = Server(config)

    def stop_on_engine_death(error: BaseException) -> None:
        server.should_exit = True  # read by uvicorn's main loop, which then shuts down

    async_llm.on_dead = stop_on_engine_death
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
