"""`kvrelay proxy`: the P/D proxy in front of prefill and decode instances."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "proxy", help="split requests into a prefill leg (P) and a decode leg (D)",
        description="An OpenAI-compatible proxy: each request is prefilled on a P instance, then "
                    "decoded on a D instance that takes over its KV cache.")
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances, e.g. http://127.0.0.1:8100")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL", help="decode instances")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="API key the backends require (sent as Bearer)")
    p.add_argument("--prefill-timeout", type=float, default=60.0,
                   help="seconds before a prefill leg is given up and D prefills alone (default 60)")
    p.add_argument("--transfer-mode", choices=("pull", "push"), default="pull",
                   help="pull (NixlConnector: D reads after P answered) or push (NixlPushConnector: "
                        "both legs at once, P writes into D's blocks while it computes)")
    p.add_argument("--prefill-kv", nargs="+", default=[], metavar="HOST:PORT",
                   help="push mode: each prefill instance's KV side channel (its kv_ip:kv_port), "
                        "in the order of --prefill")
    p.add_argument("--log-level", default="warning", help="uvicorn log level (default warning)")
    p.set_defaults(func=cmd_proxy)


def cmd_proxy(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from kvrelay.disagg.proxy import ProxyConfig, build_app

    if args.prefill_timeout <= 0:
        raise ValueError(f"--prefill-timeout must be > 0, got {args.prefill_timeout}")
    config = ProxyConfig(prefill_urls=tuple(args.prefill), decode_urls=tuple(args.decode),
                         api_key=args.api_key, prefill_timeout=args.prefill_timeout,
                         transfer_mode=args.transfer_mode, prefill_kv_addresses=tuple(args.prefill_kv))
    app = build_app(config)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(f"kvrelay proxy on http://{args.host}:{args.port}  prefill: {' '.join(args.prefill)}  "
          f"decode: {' '.join(args.decode)}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False)
    return 0
