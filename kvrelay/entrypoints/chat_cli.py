"""`kvrelay generate PROMPT` and `kvrelay chat`: the model in a terminal, streamed as it generates.

Tokens are printed as the engine produces them. Ctrl-C during an answer stops that answer: the
request is aborted between two engine steps (never inside one), so the engine stays sound, and
`chat` returns to its prompt with the conversation kept. Ctrl-C or Ctrl-D at the prompt ends the
chat. A conversation that outgrows the context is kept too: chat says so and suggests /reset.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvrelay.entrypoints.engine_args import EngineArgs, add_engine_args

if TYPE_CHECKING:
    from kvrelay import LLM, SamplingParams
    from kvrelay.outputs import CompletionOutput

HELP = "type a message; /reset starts over; Ctrl-C stops an answer; Ctrl-D (or Ctrl-C here) quits."


def add_parser(sub: Any) -> None:
    gen = sub.add_parser("generate", help="generate a completion for one prompt, streamed",
                         description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gen.add_argument("prompt")
    gen.add_argument("--no-chat-template", dest="use_chat_template", action="store_false",
                     help="send the prompt as raw text instead of a chat message")
    add_engine_args(gen, "generate", model="flag")  # the prompt is the positional here
    _add_sampling_args(gen)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="an interactive chat in the terminal, streamed",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(chat, "chat")
    _add_sampling_args(chat)
    chat.add_argument("--system", default=None, help="a system message")
    chat.set_defaults(func=cmd_chat)


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="tokens per answer at most (default 128)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--ignore-eos", action="store_true",
                   help="go on past the end-of-sequence token, up to --max-tokens (for timing)")


def _build_llm(args: argparse.Namespace) -> LLM:
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.create_engine_config()  # bad flags fail here, naming the flag, before the model loads
    engine_args.set_torch_threads()
    from kvrelay import LLM
    return LLM(**engine_args.llm_kwargs())


def _sampling(args: argparse.Namespace) -> SamplingParams:
    from kvrelay import SamplingParams
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, ignore_eos=args.ignore_eos)


# ---------------------------------------------------------------------------- streaming


@contextlib.contextmanager
def ctrl_c_stops() -> Iterator[threading.Event]:
    """While the block runs, Ctrl-C (SIGINT) sets the event instead of raising, so the caller
    stops between two engine steps. The previous handler is back after the block."""
    stop = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_answer(llm: LLM, prompt: dict[str, Any], params: SamplingParams,
                  stop: threading.Event) -> Iterator[CompletionOutput]:
    """One request's outputs as the engine steps; `stop` set: the request is aborted after the
    current step. Either way nothing of it is left in the engine when the iterator ends."""
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    finished = False
    try:
        while not finished and not stop.is_set():
            for out in engine.step():
                if out.request_id == request_id:
                    finished = out.finished
                    yield out.outputs[0]
    finally:
        if not finished:
            engine.abort_request(request_id)
        engine.run_until_idle(include_held=False)


def print_stream(outputs: Iterator[CompletionOutput]) -> CompletionOutput | None:
    """Write each output's new text as it comes; the last output (None if there was none)."""
    last = None
    for last in outputs:
        if last.delta_text:
            sys.stdout.write(last.delta_text)
            sys.stdout.flush()
    return last


# ---------------------------------------------------------------------------- commands


def cmd_generate(args: argparse.Namespace) -> int:
    start = time.monotonic()
    llm = _build_llm(args)
    loaded_s = time.monotonic() - start
    if args.use_chat_template:
        prompt = chat_prompt(llm, [{"role": "user", "content": args.prompt}])
    else:
        prompt = {"prompt": args.prompt}
    start = time.monotonic()
    with ctrl_c_stops() as stop:
        out = print_stream(stream_answer(llm, prompt, _sampling(args), stop))
    gen_s = time.monotonic() - start
    print(flush=True)
    n = len(out.token_ids) if out is not None else 0
    reason = out.finish_reason if out is not None and out.finish_reason else "abort"
    stopped = " (stopped by Ctrl-C)" if stop.is_set() else ""
    print(f"\n[{n} tokens in {gen_s:.2f} s ({n / max(gen_s, 1e-9):.1f} tok/s), model loaded in "
          f"{loaded_s:.2f} s, finish_reason={reason}{stopped}]", file=sys.stderr)
    return 130 if stop.is_set() else 0


def chat_prompt(llm: LLM, messages: list[dict[str, str]]) -> dict[str, Any]:
    from kvrelay.engine.llm import chat_prompt as render
    return render(llm.tokenizer, messages)


class ChatSession:
    """One conversation in the terminal: its messages, and what each command does to them."""

    def __init__(self, llm: LLM, params: SamplingParams, system: str | None) -> None:
        self.llm, self.params = llm, params
        self.first: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
        self.messages = list(self.first)

    def reset(self) -> None:
        dropped = (len(self.messages) - len(self.first)) // 2
        self.messages = list(self.first)
        kept = " (the system message stays)" if self.first else ""
        note(f"conversation reset: {dropped} exchange(s) forgotten{kept}")

    def ask(self, line: str) -> None:
        self.messages.append({"role": "user", "content": line})
        prompt = chat_prompt(self.llm, self.messages)
        limit = self.llm.engine.max_model_len
        if len(prompt["prompt_token_ids"]) >= limit:
            self.messages.pop()
            note(f"not sent: the conversation with this message is {len(prompt['prompt_token_ids'])} "
                 f"tokens and the context holds {limit} (max_model_len). The conversation is kept: "
                 "/reset starts over, or send something shorter")
            return
        with ctrl_c_stops() as stop:
            out = print_stream(stream_answer(self.llm, prompt, self.params, stop))
        print(flush=True)
        reply = out.text if out is not None else ""
        self.messages.append({"role": "assistant", "content": reply})
        if stop.is_set():
            note("stopped (Ctrl-C); the answer so far stays in the conversation")
        elif out is not None and len(prompt["prompt_token_ids"]) + len(out.token_ids) >= limit:
            note(f"the answer reached the end of the context ({limit} tokens, max_model_len); the "
                 "conversation is kept, but /reset starts over with room to answer")


def note(message: str) -> None:
    print(f"[{message}]", file=sys.stderr, flush=True)


def cmd_chat(args: argparse.Namespace) -> int:
    session = ChatSession(_build_llm(args), _sampling(args), args.system)
    print(f"kvrelay chat: {HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            session.reset()
            continue
        session.ask(line)
