"""`kvrelay demo`: a few streamed chat requests through a P/D cluster, with what happened where."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo", help="send a few chat requests to a cluster and show TTFT, ITL and the P/D split",
        description="Stream a few chat requests through a kvrelay proxy (started by `kvrelay up`), "
                    "then show from the instances' metrics where the prompt was computed and how "
                    "much KV moved.")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the proxy (default %(default)s)")
    p.add_argument("--requests", type=int, default=3, help="how many requests (default 3)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--prompt", action="append", default=None,
                   help="your own prompt (repeatable; replaces the built-in ones)")
    p.add_argument("--api-key", default=None,
                   help="the key the cluster requires (`kvrelay up --api-key`; default: env KVRELAY_API_KEY)")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    import httpx

    from kvrelay import env
    from kvrelay.disagg.demo import run_demo

    if args.requests < 1:
        raise ValueError(f"--requests must be >= 1, got {args.requests}")
    try:
        results = run_demo(args.url, args.requests, args.max_tokens, args.prompt,
                           api_key=args.api_key or env.api_key())
    except httpx.HTTPError as e:
        raise ValueError(f"cannot reach {args.url} ({e!r}); is `kvrelay up` running?") from None
    return 0 if all(r.ok for r in results) else 1
