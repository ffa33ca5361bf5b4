"""kvrelay: an LLM serving engine whose KV cache can leave the instance that computed it.

Run a model in the terminal (generate, chat), serve it over an OpenAI-compatible API (serve),
split prefill and decode over instances (proxy, up, pool, demo), and plan how many of each a
workload needs (profile, plan). `kvrelay COMMAND --help` describes each command.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

import kvrelay


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=kvrelay.__version__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # Each of these modules defines add_parser(sub) and keeps its heavy imports inside the command.
    for module in _SUBCOMMAND_MODULES:
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    return parser


_SUBCOMMAND_MODULES = (
    "kvrelay.entrypoints.chat_cli",    # kvrelay generate, kvrelay chat
    "kvrelay.entrypoints.serve_cli",   # kvrelay serve
    "kvrelay.disagg.proxy_cli",        # kvrelay proxy
    "kvrelay.disagg.launcher_cli",     # kvrelay up
    "kvrelay.disagg.pool_cli",         # kvrelay pool
    "kvrelay.disagg.demo_cli",         # kvrelay demo
    "kvrelay.disagg.planner.cli",      # kvrelay profile, kvrelay plan
)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except (ValueError, FileNotFoundError) as e:
        print(f"kvrelay: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
