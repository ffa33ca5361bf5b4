"""The `kvrelay` command: generate, chat (and later serve, proxy, up)."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrelay.entrypoints.engine_args import EngineArgs, add_engine_args

if TYPE_CHECKING:
    from kvrelay import LLM, SamplingParams


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)


def _build_llm(args: argparse.Namespace) -> LLM:
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.create_engine_config()  # bad flags fail here, naming the flag, before the model loads
    engine_args.set_torch_threads()
    from kvrelay import LLM
    return LLM(**engine_args.llm_kwargs())


def _sampling(args: argparse.Namespace) -> SamplingParams:
    from kvrelay import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k)


def cmd_generate(args: argparse.Namespace) -> int:
    start = time.monotonic()
    llm = _build_llm(args)
    loaded_s = time.monotonic() - start
    params = _sampling(args)
    start = time.monotonic()
    if args.chat_template:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    gen_s = time.monotonic() - start
    out = outputs[0].outputs[0]
    print(out.text)
    n = len(out.token_ids)
    print(f"\n[{n} tokens in {gen_s:.2f} s ({n / max(gen_s, 1e-9):.1f} tok/s), model loaded in "
          f"{loaded_s:.2f} s, finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    llm = _build_llm(args)
    params = _sampling(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvrelay chat: type a message, /reset to start over, Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(reply, flush=True)
        messages.append({"role": "assistant", "content": reply})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvrelay", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument("prompt")
    gen.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                     help="send the prompt as raw text instead of a chat message")
    add_engine_args(gen, "generate", model="flag")  # the prompt is the positional here
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="an interactive chat in the terminal")
    add_engine_args(chat, "chat")
    _add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="a system message")
    chat.set_defaults(func=cmd_chat)
    # Each of these modules defines add_parser(sub) and keeps its heavy imports inside the command.
    for module in _SUBCOMMAND_MODULES:
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
    return parser


_SUBCOMMAND_MODULES = (
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
