"""`kvrelay pool`: list, add and drain the instances of a running proxy (or `kvrelay up --admin`).

    kvrelay pool list
    kvrelay pool add --role decode                       # kvrelay up --admin: start a new one
    kvrelay pool add --role decode --url http://h:8300   # an instance already running
    kvrelay pool drain http://h:8200                     # waits until it has left the pool

It talks to the admin API (docs/routing.md) at --admin-url with --admin-key (default: env
KVRELAY_ADMIN_KEY).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("pool", help="list, add and drain the instances of a running P/D pool",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--admin-url", default="http://127.0.0.1:8000",
                   help="the proxy, or the admin endpoint `kvrelay up --admin` printed (default %(default)s)")
    p.add_argument("--admin-key", default=None, help="the admin key (default: env KVRELAY_ADMIN_KEY)")
    verbs = p.add_subparsers(dest="verb", required=True)
    verbs.add_parser("list", help="every instance: role, state, legs in flight, KV index")
    add = verbs.add_parser("add", help="add an instance (without --url, `kvrelay up --admin` starts one)")
    add.add_argument("--role", choices=("prefill", "decode"), required=True)
    add.add_argument("--url", default=None, help="a running instance, e.g. http://127.0.0.1:8300")
    add.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                     help="where it publishes KV events (kvrelay instances say it themselves)")
    add.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT", help="its replay endpoint")
    add.add_argument("--kv-events-topic", default="", help="its KV events topic")
    add.add_argument("--kv-address", default=None, metavar="HOST:PORT",
                     help="push-mode clusters: a prefill instance's KV side channel")
    drain = verbs.add_parser("drain", help="stop sending an instance work; it leaves once idle")
    drain.add_argument("url")
    drain.add_argument("--force", action="store_true", help="even if it is the last active one of its role")
    drain.add_argument("--no-wait", action="store_true",
                       help="return at once instead of waiting until it left")
    drain.add_argument("--timeout", type=float, default=600.0, help="seconds to wait (default 600)")
    p.set_defaults(func=cmd_pool)


def cmd_pool(args: argparse.Namespace) -> int:
    import httpx

    from kvrelay import env

    key = args.admin_key or env.admin_key()
    if not key:
        raise ValueError("no admin key: pass --admin-key or set KVRELAY_ADMIN_KEY")
    base = args.admin_url.rstrip("/") + "/admin/instances"
    headers = {"Authorization": f"Bearer {key}"}

    def call(method: str, path: str = "", body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        try:
            response = httpx.request(method, base + path, json=body, headers=headers, timeout=900,
                                     trust_env=False)
            return response.status_code, response.json()
        except (httpx.HTTPError, ValueError) as e:
            return 0, {"error": {"message": f"{args.admin_url} did not answer: {e!r}"}}

    if args.verb == "list":
        status, answer = call("GET")
        return _report(status, answer, _table)
    if args.verb == "add":
        status, answer = call("POST", "", _add_body(args))
        return _report(status, answer, lambda a: f"added: {_row(a['instance'])}")
    status, answer = call("POST", "/drain", {"url": args.url, "force": args.force})
    if status != 202 or args.no_wait:
        return _report(status, answer, lambda a: f"draining: {_row(a['instance'])}")
    print(f"draining {args.url}: waiting until its work is done ...", flush=True)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        status, answer = call("GET")
        if status == 200 and all(i["url"] != args.url.rstrip("/") for i in answer["instances"]):
            print(f"{args.url} left the pool", flush=True)
            return 0
        time.sleep(0.5)
    print(f"kvrelay pool: {args.url} still has work after {args.timeout:.0f} s", file=sys.stderr)
    return 1


def _add_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"role": args.role}
    if args.url:
        body["url"] = args.url
    if args.kv_address:
        body["kv_address"] = args.kv_address
    if args.kv_events:
        body["kv_events"] = {"endpoint": args.kv_events, "replay_endpoint": args.kv_events_replay,
                             "topic": args.kv_events_topic}
    return body


def _report(status: int, answer: dict[str, Any], render: Any) -> int:
    if 200 <= status < 300:
        print(render(answer), flush=True)
        return 0
    message = (answer.get("error") or {}).get("message", answer)
    print(f"kvrelay pool: error{f' (HTTP {status})' if status else ''}: {message}", file=sys.stderr)
    return 1


def _row(instance: dict[str, Any]) -> str:
    index = instance.get("kv_index")
    cached = "" if index is None else (f"  index: {sum(index['blocks'].values())} blocks" if index["usable"]
                                       else f"  index: off ({index['reason']})")
    return (f"{instance['role']:<8} {instance['state']:<9} {instance['url']:<28} "
            f"in flight {instance['in_flight']}, readers {instance['readers']}{cached}")


def _table(answer: dict[str, Any]) -> str:
    routing = answer.get("routing", {})
    lines = [f"routing: prefill {routing.get('prefill')}, decode {routing.get('decode')}"]
    lines += [_row(i) for i in answer["instances"]]
    return "\n".join(lines)
