"""`kvrelay proxy`: the P/D proxy in front of prefill and decode instances."""

from __future__ import annotations

import argparse
from typing import Any

from kvrelay.disagg.routing.hash_schemes import VLLM_HASH_ALGOS
from kvrelay.disagg.routing.policies import DEFAULT_POLICY, POLICIES
from kvrelay.utils import HTTP_KEEP_ALIVE_S as KEEP_ALIVE_S
from kvrelay.utils import busy_port_error


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """--routing / --prefill-routing / --decode-routing, shared by `kvrelay proxy` and `kvrelay up`."""
    g = p.add_argument_group("routing (docs/routing.md)")
    g.add_argument("--routing", choices=POLICIES, default=None,
                   help=f"how both pools pick an instance (default {DEFAULT_POLICY}): kv-aware weighs each "
                        "instance's cached prefix of the prompt (from its KV events) against its load")
    g.add_argument("--prefill-routing", choices=POLICIES, default=None,
                   help="the prefill pool's policy (default: --routing)")
    g.add_argument("--decode-routing", choices=POLICIES, default=None,
                   help="the decode pool's policy (default: --routing)")


def routing_of(args: argparse.Namespace) -> tuple[str, str]:
    """(prefill policy, decode policy) from the routing flags."""
    both = args.routing or DEFAULT_POLICY
    return args.prefill_routing or both, args.decode_routing or both


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "proxy", help="split requests into a prefill leg (P) and a decode leg (D)",
        description="An OpenAI-compatible proxy: each request is prefilled on a P instance, then "
                    "decoded on a D instance that takes over its KV cache.")
    p.add_argument("--prefill", nargs="*", default=[], metavar="URL",
                   help="prefill instances, e.g. http://127.0.0.1:8100 (none: no P/D, each request goes "
                        "whole to one --decode instance)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="API key the backends require, sent as Bearer (default: env KVRELAY_API_KEY, which "
                        "clients must then send too, as to `kvrelay serve`; /health and /metrics stay open)")
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds before a prefill leg is given up and D prefills alone (default 60)")
    p.add_argument("--transfer-mode", choices=("pull", "push"), default="pull",
                   help="pull (NixlConnector: D reads after P answered) or push (NixlPushConnector: "
                        "both legs at once, P writes into D's blocks while it computes)")
    p.add_argument("--prefill-kv", nargs="+", default=[], metavar="HOST:PORT",
                   help="push mode: each prefill instance's KV side channel (its kv_ip:kv_port), "
                        "in the order of --prefill")
    add_routing_args(p)
    p.add_argument("--model", default=None,
                   help="kv-aware routing: the model whose tokenizer hashes prompts, as given to "
                        "`kvrelay serve` (default: serve's default model); no weights are loaded")
    p.add_argument("--chat-template", default=None,
                   help="kv-aware routing: the --chat-template the instances run (a file, or the template), "
                        "so the proxy renders chat prompts as they do")
    p.add_argument("--vllm-prefix-caching-hash-algo", choices=VLLM_HASH_ALGOS, default=None,
                   help="kv-aware routing: the --prefix-caching-hash-algo of the vLLM instances (default: "
                        "found from their KV events; sha256 is vLLM's default)")
    p.add_argument("--vllm-pythonhashseed", default=None, metavar="SEED",
                   help="kv-aware routing: the PYTHONHASHSEED the vLLM instances run with, if set (it seeds "
                        "their block hashes; without it the proxy cannot reproduce them)")
    p.add_argument("--admin-key", default=None,
                   help="turn the admin API on (/admin/instances: add and drain instances) with this key "
                        "(default: env KVRELAY_ADMIN_KEY; unset: the admin API is off)")
    p.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between health checks of every instance; one that fails leaves routing "
                        "until it answers again (default 2; 0: no checks)")
    p.add_argument("--keepalive-expiry", type=float, default=2.0,
                   help="seconds an idle connection to an instance is kept for the next leg; keep it "
                        "below the instances' keep-alive timeout (uvicorn, vLLM and kvrelay serve: 5 s) "
                        "(default 2)")
    p.add_argument("--timeout-keep-alive", type=int, default=KEEP_ALIVE_S, metavar="SECONDS",
                   help=f"seconds before an idle client connection is closed (default {KEEP_ALIVE_S}, as "
                        "kvrelay serve and vLLM); a load balancer in front must drop idle connections sooner")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    p.set_defaults(func=cmd_proxy)


def uvicorn_config(app: Any, args: argparse.Namespace) -> Any:
    """The proxy's HTTP server settings from its flags (a uvicorn.Config)."""
    import uvicorn

    return uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                          timeout_keep_alive=args.timeout_keep_alive)


def cmd_proxy(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    import uvicorn

    from kvrelay import env
    from kvrelay.disagg.pool_manager import check_instances
    from kvrelay.disagg.proxy import ProxyConfig, build_app

    if args.prefill_timeout <= 0:
        raise ValueError(f"--prefill-timeout must be > 0, got {args.prefill_timeout}")
    if args.timeout_keep_alive < 1:
        raise ValueError(f"--timeout-keep-alive must be at least 1 second, got {args.timeout_keep_alive}")
    busy = busy_port_error(args.host, args.port)  # before the tokenizer loads (kv-aware routing)
    if busy is not None:
        raise ValueError(busy)
    prefill_routing, decode_routing = routing_of(args)
    client_key = env.api_key()
    tokenizer = _tokenizer_with_template(args.model, args.chat_template) if args.chat_template else None
    config = ProxyConfig(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
                         api_key=args.api_key or client_key, prefill_timeout=args.prefill_timeout,
                         transfer_mode=args.transfer_mode, prefill_kv_addresses=tuple(args.prefill_kv),
                         prefill_routing=prefill_routing, decode_routing=decode_routing, model=args.model,
                         tokenizer=tokenizer,
                         admin_key=args.admin_key or env.admin_key(), health_interval=args.health_interval,
                         keepalive_expiry=args.keepalive_expiry,
                         vllm_prefix_caching_hash_algo=args.vllm_prefix_caching_hash_algo,
                         vllm_pythonhashseed=args.vllm_pythonhashseed)
    asyncio.run(check_instances(config))  # another transfer mode: one line, exit 2
    app: Any = build_app(config)
    if client_key is not None:
        from kvrelay.entrypoints.auth import RequireAPIKey
        app = RequireAPIKey(app, client_key)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prefill = " ".join(args.prefill) or "none (no P/D)"
    print(f"kvrelay proxy on http://{args.host}:{args.port}  prefill: {prefill}  "
          f"decode: {' '.join(args.decode)}  routing: prefill {prefill_routing}, decode {decode_routing}"
          f"{'  admin API on' if config.admin_key else ''}", flush=True)
    uvicorn.Server(uvicorn_config(app, args)).run()  # a start that fails exits 3 (uvicorn's status)
    return 0


def _tokenizer_with_template(model: str | None, chat_template: str) -> Any:
    """The model's tokenizer rendering chats with `chat_template` (as `serve --chat-template`)."""
    from kvrelay.entrypoints.engine_args import EngineArgs
    from kvrelay.model.loader import load_tokenizer

    template = EngineArgs(chat_template=chat_template).chat_template_text()
    assert template is not None
    tokenizer = load_tokenizer(model)
    tokenizer.set_chat_template(template)
    return tokenizer
