"""`kvrelay serve [MODEL]`: one instance behind an OpenAI-compatible HTTP API.

Heavy imports (torch, fastapi, uvicorn) happen inside the command, so `kvrelay --help` stays fast.
SIGTERM and SIGINT stop the server gracefully: open connections get a few seconds, then the
engine thread is stopped and joined, and the process exits with status 0. If the engine dies
(a worker process of a tensor-parallel instance died or hung), requests in flight fail, /health
answers 503, the server stops and the process exits with status 1.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

logger = logging.getLogger("kvrelay.serve")

_GRACEFUL_SHUTDOWN_S = 5


def add_parser(sub: Any) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or a Hugging Face directory "
                        "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: from the model)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: env KVRELAY_API_KEY)")
    p.add_argument("--kv-transfer-config", default=None, help="KV connector config as a JSON object")
    p.add_argument("--kv-events-config", default=None,
                   help="publish KV cache events (vLLM's flag and keys), a JSON object, e.g. "
                        "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                        "\"replay_endpoint\": \"tcp://*:5558\"}' (see docs/routing.md)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="512MiB", help="bytes for the KV cache, e.g. 1GiB")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="what the KV cache stores: auto (the model's dtype, default), float32, "
                        "bfloat16, float16, fp8_e4m3 (fp8), fp8_e5m2")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="float32", help="float32 (default), bfloat16 or float16")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many worker processes (default 1)")
    p.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp"],
                   help="'uni': the worker runs in the server's process (default at TP 1); "
                        "'mp': one worker process per rank (default above TP 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads for this instance")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_serve)


def build_engine_config(args: argparse.Namespace) -> Any:
    from kvrelay.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
    from kvrelay.kv_events.config import KVEventsConfig
    from kvrelay.kv_transfer.config import KVTransferConfig

    return EngineConfig(
        model=ModelConfig(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                          seed=args.seed, served_model_name=args.served_model_name),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                          cache_dtype=args.kv_cache_dtype),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                  max_num_batched_tokens=args.max_num_batched_tokens),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                distributed_executor_backend=args.distributed_executor_backend),
        kv_transfer=KVTransferConfig.from_any(args.kv_transfer_config),
        kv_events=KVEventsConfig.from_any(args.kv_events_config))


def cmd_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    config = build_engine_config(args)  # bad flags fail here, before the model loads

    import torch
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from kvrelay import env
    from kvrelay.engine.async_llm import AsyncLLM
    from kvrelay.engine.llm_engine import LLMEngine
    from kvrelay.entrypoints.openai_server import build_app

    engine = LLMEngine(config)
    async_llm = AsyncLLM(engine)
    try:
        app = build_app(async_llm, engine.model_name, args.api_key or env.api_key())
        _run_uvicorn(app, args, engine.model_name, async_llm)
    finally:
        async_llm.shutdown()
        engine.shutdown()  # NOTE: after a crash the engine thread did not: stop the workers here
        others = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
        if others:
            logger.warning("threads still running at exit: %s", ", ".join(others))
    if async_llm.crashed:
        logger.error("kvrelay serve stopped: %s", async_llm.dead_reason)
        return 1
    logger.info("kvrelay serve stopped")
    return 0


def _run_uvicorn(app: Any, args: argparse.Namespace, model_name: str, async_llm: Any) -> None:
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                logger.info("kvrelay serve ready: http://%s:%d (model %r)", host, port, model_name)

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=args.log_level == "debug",
                            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S)
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
