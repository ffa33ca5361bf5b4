"""`kvrelay up`: a local prefill/decode cluster behind one OpenAI-compatible endpoint."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from kvrelay.disagg.proxy_cli import add_routing_args, routing_of
from kvrelay.entrypoints.engine_args import EngineArgs, add_engine_args, given_engine_argv

_PLACED_PER_INSTANCE = ("device", "gpu_memory_utilization")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "up", help="start prefill + decode instances and the proxy on this machine",
        description="Start P and D `kvrelay serve` processes and the P/D proxy on loopback ports, "
                    "wait until all are healthy, and serve until Ctrl-C.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="the proxy's port (0: any free port)")
    p.add_argument("--connector", default=None,
                   help="KV connector linking P and D (default: NixlConnector, a pull; NixlPushConnector: P "
                        "pushes each layer into D's blocks while it computes)")
    p.add_argument("--kv-backend", default=None, choices=("nixl", "tcp", "mooncake", "cuda_ipc"),
                   help="transport of the Nixl connectors (default: on the CPU nixl where installed, else "
                        "tcp; on GPUs the fastest working path, printed at start: cuda_ipc, nixl on VRAM, "
                        "host staging; mooncake: Mooncake's Transfer Engine, kvrelay[mooncake])")
    p.add_argument("--prefill-instances", type=int, default=1)
    p.add_argument("--decode-instances", type=int, default=1)
    p.add_argument("--prefill-tp", type=int, default=1,
                   help="tensor-parallel size of each prefill instance (default 1)")
    p.add_argument("--decode-tp", type=int, default=1,
                   help="tensor-parallel size of each decode instance (default 1)")
    p.add_argument("--prefill-dp", type=int, default=1,
                   help="data-parallel ranks of each prefill instance, behind its one URL (default 1)")
    p.add_argument("--decode-dp", type=int, default=1,
                   help="data-parallel ranks of each decode instance, behind its one URL (default 1)")
    p.add_argument("--threads-per-instance", type=int, default=None,
                   help="torch threads per instance (default: the cores split evenly)")
    add_routing_args(p)
    adm = p.add_argument_group("a pool that changes while it runs (docs/routing.md)")
    adm.add_argument("--admin", action="store_true",
                     help="serve an admin endpoint (key: env KVRELAY_ADMIN_KEY, else a new one, printed) "
                          "that starts, adds and drains instances: `kvrelay pool add|drain|list`")
    adm.add_argument("--admin-port", type=int, default=0, help="its port (default: any free one)")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="keep the children's logs here")
    off = p.add_argument_group("offload tiers for the decode instances (OffloadConnector)")
    off.add_argument("--offload", action="store_true",
                     help="enable them (CPU memory, 1GiB, unless the flags below say otherwise)")
    off.add_argument("--offload-cpu-bytes", default=None, help="host-memory tier budget, e.g. 4GiB")
    off.add_argument("--offload-disk-dir", default=None, help="disk tier directory")
    off.add_argument("--offload-disk-bytes", default=None, help="disk tier budget, e.g. 64GiB")
    off.add_argument("--offload-remote-url", default=None,
                     help="shared tier: Redis, redis://host:port/db, or a Mooncake Store master, "
                          "mooncakestore://host:port (two clusters can share prefixes through it)")
    # NOTE: defaults=False: a flag not given is not passed on, so each instance keeps serve's default.
    add_engine_args(p, "up", defaults=False, title="engine",
                    description="passed on to every instance (default: serve's). --device auto|cpu|cuda|"
                                "cuda:N places the instances (auto: on the GPUs when there are any, each "
                                "on its own while there are enough); --gpu-memory-utilization (default "
                                "0.9) is split between instances that share a GPU.")
    p.set_defaults(func=cmd_up)


def offload_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """The OffloadConnector extra config the --offload* flags ask for, or None."""
    tiers = {"cpu_bytes": args.offload_cpu_bytes, "disk_dir": args.offload_disk_dir,
             "disk_bytes": args.offload_disk_bytes, "remote_url": args.offload_remote_url}
    chosen = {k: v for k, v in tiers.items() if v is not None}
    if not chosen and not args.offload:
        return None
    if not any(k in chosen for k in ("cpu_bytes", "disk_dir", "remote_url")):
        chosen["cpu_bytes"] = "1GiB"
    return chosen


def serve_args_of(args: argparse.Namespace) -> list[str]:
    """The `kvrelay serve` flags every instance of the cluster gets from `kvrelay up`'s engine
    flags: those given (P and D must agree on e.g. --kv-cache-dtype: one flag sets it for both).
    --device and --gpu-memory-utilization are set per instance (kvrelay/disagg/placement.py).
    A bad value raises ValueError naming the flag here, before any child starts."""
    EngineArgs.from_cli_args(args).create_engine_config()
    return given_engine_argv(args, "up", skip=_PLACED_PER_INSTANCE)


def cmd_up(args: argparse.Namespace) -> int:
    import secrets
    import signal

    from kvrelay import env
    from kvrelay.disagg.launcher import DEFAULT_CONNECTOR, ClusterError, ClusterSpec, LocalCluster

    serve_args = serve_args_of(args)
    engine_args = EngineArgs.from_cli_args(args)
    prefill_routing, decode_routing = routing_of(args)
    admin_key = (env.admin_key() or secrets.token_urlsafe(24)) if args.admin else None
    spec = ClusterSpec(model=args.model, host=args.host, port=args.port,
                       connector=args.connector or DEFAULT_CONNECTOR,
                       num_prefill=args.prefill_instances, num_decode=args.decode_instances,
                       threads_per_instance=args.threads_per_instance, serve_args=tuple(serve_args),
                       startup_timeout=args.startup_timeout, log_dir=args.log_dir,
                       offload=offload_config(args), prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                       prefill_dp=args.prefill_dp, decode_dp=args.decode_dp,
                       kv_backend=args.kv_backend, device=engine_args.device,
                       gpu_memory_utilization=engine_args.gpu_memory_utilization,
                       prefill_routing=prefill_routing, decode_routing=decode_routing, admin_key=admin_key)
    cluster = LocalCluster(spec)  # where each instance runs, or ValueError: nothing has started yet

    def on_sigterm(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    print(f"kvrelay up: starting {spec.num_prefill} prefill + {spec.num_decode} decode instance(s), "
          f"{spec.threads} thread(s) each, connector {spec.connector} ...", flush=True)
    for placement in cluster.placements:
        print(f"  {placement.name:<10} on {placement.describe()}", flush=True)
    if cluster.transfer_path is not None:
        print(f"  KV transfer: {cluster.transfer_path.describe()}", flush=True)
    admin = None
    try:
        cluster.start()
        _print_ready(cluster)
        if admin_key is not None:
            admin = _start_admin(cluster, admin_key, args.admin_port, from_env=env.admin_key() is not None)
        dead = cluster.wait_for_exit(instances_may_exit=admin is not None)
        print(f"kvrelay up: {dead.name} exited with code {dead.exit_code()}; stopping the cluster. "
              f"Last lines of its log:\n{dead.log_tail()}", file=sys.stderr, flush=True)
        return 1
    except ClusterError as e:
        print(f"kvrelay up: error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nkvrelay up: stopping ...", file=sys.stderr, flush=True)
        return 0
    finally:
        if admin is not None:
            admin.stop()
        cluster.stop()
        print("kvrelay up: stopped.", file=sys.stderr, flush=True)


def _start_admin(cluster: Any, admin_key: str, port: int, from_env: bool) -> Any:
    from kvrelay.disagg.launcher_admin import LauncherAdmin

    admin = LauncherAdmin(cluster, admin_key, cluster.spec.host, port)
    admin.start()
    key_hint = "the key in KVRELAY_ADMIN_KEY" if from_env else f"export KVRELAY_ADMIN_KEY={admin_key}"
    print(f"kvrelay up: admin endpoint {admin.url} ({key_hint})\n"
          f"  kvrelay pool --admin-url {admin.url} add --role decode     # start one more decode instance\n"
          f"  kvrelay pool --admin-url {admin.url} drain URL             # finish its work, then stop it\n"
          f"  kvrelay pool --admin-url {admin.url} list", flush=True)
    return admin


def _print_ready(cluster: Any) -> None:
    import httpx

    try:
        model = httpx.get(cluster.url + "/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError):
        model = "default"
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is a KV cache?"}],
                       "max_tokens": 64})
    lines = [f"kvrelay up: ready at {cluster.url}  (model {model})"]
    for child in cluster.children:
        lines.append(f"  {child.name:<10} {child.url}  pid {child.pid}  log {child.log_path}")
    lines += ["", "Try:",
              f"  curl -s {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' \\",
              f"    -d '{body}'",
              f"  kvrelay demo --url {cluster.url}",
              "", "Ctrl-C stops everything."]
    print("\n".join(lines), flush=True)
