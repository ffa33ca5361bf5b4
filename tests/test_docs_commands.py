"""Every `kvrelay ...` command in README.md and docs/*.md runs from a clone as written.

Each command is parsed by kvrelay's own argument parser (every subcommand and flag exists, every
value parses, the JSON configs and the engine flags included), each file it reads exists in the
repository or is written by an earlier command on the same page, and every command that starts a
server has the test that runs that kind of command named in EXERCISED below (checked to exist).

Commands are the lines of shell blocks (```sh) that run `kvrelay` or `.venv/bin/kvrelay`, and the
`$ `-prompted lines of other blocks (transcripts); a shell variable assigned earlier in the page
(`COMMON="..."`) is expanded. Upper-case words in PLACEHOLDERS stand for what the reader fills in;
the page says what. Inline code in prose that names a command (`kvrelay up --admin`) must name a
real subcommand and real flags of it.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvrelay.entrypoints.cli import build_parser
from kvrelay.entrypoints.engine_args import ENGINE_COMMANDS, EngineArgs

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = {"sh", "bash", "shell", "console"}
KVRELAY = ("kvrelay", ".venv/bin/kvrelay")
# What the reader puts in: a model directory, a model, the admin endpoint's URL or port.
PLACEHOLDERS = {"MODEL_DIR", "MODEL", "URL", "PORT"}
# Flags naming a file the command reads, and flags naming one it writes, by subcommand.
READS = {"plan": ("profile", "pd_profile", "trace"), "proxy": ("model", "chat_template"),
         **{c: ("model", "chat_template") for c in ENGINE_COMMANDS}}
WRITES = {"profile": ("output",), "plan": ("plot", "json_out")}
SERVER_COMMANDS = ("serve", "proxy", "up")

# Each shape of server-starting command in the docs -> the test that starts one like it. A shape
# is the subcommand, its flags (but --host/--port/--log-level) and, for serve, the connector.
E2E = "tests/disagg/test_pd_e2e.py::"
UP_SIGINT = E2E + "test_kvrelay_up_serves_a_request_and_sigint_leaves_no_process_behind"
PUSH = ("tests/disagg/test_up_push.py::"
        "test_push_cluster_answers_equal_a_single_instance_and_d_computes_one_token")
DP_UP = ("tests/disagg/test_up_data_parallel.py::"
         "test_answers_through_the_proxy_equal_one_engine_and_d_loads_every_prompt_from_p")
BATCH_INVARIANT_UP = ("tests/disagg/test_up_batch_invariant.py::"
                      "test_answers_through_p_and_d_are_bitwise_a_single_instances")
EXERCISED = {
    "serve": "tests/entrypoints/test_openai_server.py::"
             "test_api_key_is_required_on_every_route_but_health_and_metrics",
    "serve --kv-transfer-config NixlConnector":
        E2E + "test_greedy_answers_through_the_proxy_equal_a_single_instance_and_d_does_not_recompute",
    # P and D engine processes pulling over Mooncake's Transfer Engine (parametrized by backend)
    # a kvrelay instance beside vLLM instances (nixl, the default backend), pairing with a vLLM D
    "serve --block-size --dtype --kv-transfer-config NixlConnector/nixl":
        "tests/integrations/vllm/test_pd.py::test_kvrelay_p_feeds_a_vllm_d",
    "serve --kv-transfer-config NixlConnector/mooncake":
        "tests/kv_transfer/pull/test_pull_processes.py::test_processes_reproduce_single_instance_tokens",
    "serve --kv-transfer-config NixlPushConnector": PUSH,
    # every instance `kvrelay up` starts publishes its KV events (on ipc://), read by its proxy
    "serve --kv-events-config": "tests/disagg/test_pool_e2e.py::"
                                "test_a_running_cluster_takes_a_new_decode_instance_and_drains_an_old_one_losing_nothing",
    "serve --tensor-parallel-size": "tests/entrypoints/test_serve_tensor_parallel.py::"
                                    "test_tp2_server_answers_like_tp1_and_dies_loudly_when_a_worker_is_killed",
    "serve --device": "tests/gpu/test_serve_gpu.py::test_serve_on_cuda_answers_a_completion_and_a_chat",
    "proxy --decode --prefill": E2E + "test_proxy_with_prefill_down_answers_via_fallback",
    "proxy --decode --prefill --prefill-kv --transfer-mode": PUSH,
    "up --decode-instances --prefill-instances": UP_SIGINT,
    "up --api-key": UP_SIGINT,
    "up --connector": PUSH,
    "up --offload-cpu-bytes --offload-remote-url":
        "tests/disagg/test_up_offload.py::test_up_with_offload_serves_through_the_proxy_and_leaks_nothing",
    # TP P and D instances pulling between each other (every pair of sizes), as `up` runs them
    "up --decode-tp --prefill-tp":
        "tests/kv_transfer/pull/test_pull_tp.py::test_every_tp_pair_answers_like_one_instance",
    "up --device": "tests/gpu/test_engine_gpu.py::test_two_instances_at_045_each_start_on_one_gpu",
    "serve --data-parallel-size --threads":
        "tests/entrypoints/test_serve_data_parallel.py::test_both_ranks_answer_through_one_port_as_one_engine_would",
    # P's ranks in `up --prefill-dp 2` are `serve -dp 2 --kv-transfer-config` children (TP 1 there)
    "serve --data-parallel-size --kv-transfer-config --tensor-parallel-size NixlConnector": DP_UP,
    "serve --data-parallel-rank --data-parallel-size":
        "tests/engine/test_data_parallel.py::test_a_rank_served_alone_takes_requests_named_for_it_only",
    "up --decode-dp --prefill-dp": DP_UP,
    # the proxy with no P/D in front of two vLLM instances, routing by their KV events
    "proxy --decode --model --routing": "tests/disagg/routing/test_vllm_routing.py::"
                                        "test_repeats_of_a_prefix_follow_the_vllm_instance_its_events_say_caches_it",
    # the P and D of `kvrelay up --batch-invariant` are `kvrelay serve --batch-invariant` processes
    "serve --batch-invariant": BATCH_INVARIANT_UP,
    "up --batch-invariant": BATCH_INVARIANT_UP,
    "up --admin --decode-instances --prefill-instances --routing":
        "tests/disagg/test_pool_e2e.py::"
        "test_a_running_cluster_takes_a_new_decode_instance_and_drains_an_old_one_losing_nothing",
}


@dataclass
class DocCommand:
    path: Path
    line: int
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: kvrelay {' '.join(self.argv)}"


def _logical_lines(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Lines joined over trailing backslashes and open quotes, with their first line number."""
    pending: tuple[int, str] | None = None
    for number, line in lines:
        start, text = pending if pending is not None else (number, "")
        text = f"{text}\n{line}" if text else line
        try:
            shlex.split(text.rstrip("\\"), comments=True)
            complete = not text.rstrip().endswith("\\")
        except ValueError:  # an open quote: the value goes on on the next line
            complete = False
        pending = None if complete else (start, text)
        if complete:
            yield start, text.replace("\\\n", " ")
    if pending is not None:
        yield pending


def _code_lines(path: Path) -> Iterator[tuple[int, str]]:
    """Command lines of `path`: every line of shell blocks, the `$ ` lines of the others (with
    the lines that continue them)."""
    lang: str | None = None
    block: list[tuple[int, str]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        fence = re.match(r"^ {0,3}```(\w*)", line)
        if fence and lang is None:
            lang, block = fence.group(1), []
            continue
        if fence:
            yield from _logical_lines(block)
            lang = None
            continue
        if lang is None:
            continue
        if lang in SHELL_BLOCKS:
            block.append((number, line))
        elif line.startswith("$ ") or (block and block[-1][1].endswith("\\")):
            block.append((number, line.removeprefix("$ ")))


def doc_commands(path: Path) -> list[DocCommand]:
    variables: dict[str, str] = {}
    found = []
    for number, text in _code_lines(path):
        words = shlex.split(text, comments=True)
        if len(words) == 1 and re.fullmatch(r"[A-Z_]+=.*", words[0]):
            name, value = words[0].split("=", 1)
            variables[name] = value
            continue
        if not words or words[0] not in KVRELAY or (len(words) > 1 and words[1].endswith(":")):
            continue  # another program, or kvrelay's output ("kvrelay up: starting ...")
        argv: list[str] = []
        for word in words[1:]:
            whole = re.fullmatch(r"\$(\w+)", word)
            if whole and whole.group(1) in variables:  # unquoted: the shell splits it into words
                argv += shlex.split(variables[whole.group(1)])
            else:  # an unknown variable stays as written, and fails whatever checks the value
                argv.append(re.sub(r"\$(\w+)", lambda m: variables.get(m.group(1), m.group(0)), word))
        found.append(DocCommand(path, number, argv))
    return found


ALL = [command for path in DOC_FILES for command in doc_commands(path)]


def parse(command: DocCommand) -> Any:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(command.argv)
    except SystemExit:
        pytest.fail(f"{command}\n{err.getvalue()}")


def test_the_docs_show_commands_to_check() -> None:
    pages = {c.path.name for c in ALL}
    assert {"README.md", "disaggregation.md", "planning.md", "serving.md", "routing.md"} <= pages
    assert len(ALL) >= 40


@pytest.mark.parametrize("command", ALL, ids=str)
def test_every_documented_command_parses_with_kvrelays_parser(command: DocCommand) -> None:
    args = parse(command)
    if args.command in ENGINE_COMMANDS:  # the engine flags' values, as the command checks them
        engine = EngineArgs.from_cli_args(args)
        assert re.fullmatch(r"auto|cpu|cuda(:\d+)?", engine.device), command
        on_this_machine = dataclasses.replace(engine, model=None, device="cpu",
                                              chat_template=_readable(engine.chat_template))
        on_this_machine.create_engine_config()
    if args.command == "serve" and args.kv_transfer_config is not None:
        from kvrelay.kv_transfer.config import KVTransferConfig
        assert KVTransferConfig.from_any(args.kv_transfer_config) is not None
    if args.command == "serve" and args.kv_events_config is not None:
        from kvrelay.kv_events.config import KVEventsConfig
        assert KVEventsConfig.from_any(args.kv_events_config).publishes


def _readable(path: str | None) -> str | None:
    return None if path is None else str(ROOT / path) if (ROOT / path).is_file() else path


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_each_file_a_command_reads_is_in_the_clone_or_written_earlier_on_its_page(path: Path) -> None:
    written: set[str] = set()
    for command in doc_commands(path):
        args = parse(command)
        for dest in READS.get(args.command, ()):
            value = getattr(args, dest, None)
            if value is None or value in PLACEHOLDERS or value == "SmolLM2-135M-Instruct":
                continue
            if dest == "chat_template" and not Path(value).suffix:
                continue  # the template itself
            assert (ROOT / value).exists() or value in written, f"{command}: {value} is not in the clone"
        written |= {getattr(args, dest) for dest in WRITES.get(args.command, ()) if getattr(args, dest, None)}


def shape(command: DocCommand) -> str:
    args = parse(command)
    parser = _subcommands(build_parser())[args.command]
    flags = set()
    for word in command.argv[1:]:
        action = parser._option_string_actions.get(word.split("=")[0])
        if action is not None and action.dest not in ("host", "port", "log_level"):
            flags.add(max(action.option_strings, key=len))
    words = [args.command, *sorted(flags)]
    config = getattr(args, "kv_transfer_config", None)
    if config:
        loaded = ast.literal_eval(config.replace("true", "True").replace("false", "False"))
        backend = loaded.get("kv_connector_extra_config", {}).get("backend")
        words.append(loaded["kv_connector"] + (f"/{backend}" if backend else ""))
    return " ".join(words)


def test_every_server_the_docs_start_is_started_by_a_test() -> None:
    starting = {shape(c): c for c in ALL if c.argv and c.argv[0] in SERVER_COMMANDS}
    missing = {s: str(c) for s, c in starting.items() if s not in EXERCISED}
    assert not missing, f"add each shape to EXERCISED with the test that starts one: {missing}"
    for test in {EXERCISED[s] for s in starting}:
        file, name = test.split("::")
        source = (ROOT / file).read_text(encoding="utf-8")
        assert re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE), f"{test} does not exist"


INLINE = re.compile(r"`(?:\.venv/bin/)?kvrelay ([a-z][^`]*)`")


def _subcommands(parser: Any) -> dict[str, Any]:
    groups = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return dict(groups[0].choices) if groups else {}


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_inline_commands_in_prose_name_real_subcommands_and_flags(path: Path) -> None:
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        for match in INLINE.finditer(line):
            where = f"{path.name}:{number}: {match.group(0)}"
            parser: Any = build_parser()
            for word in match.group(1).split():
                subcommands = _subcommands(parser)
                if word in subcommands:  # kvrelay up, kvrelay pool ... add
                    parser = subcommands[word]
                elif word.startswith("-"):
                    assert word.split("=")[0] in parser._option_string_actions, f"{where}: no {word}"
                elif parser is not None and subcommands and not word.isupper():
                    pytest.fail(f"{where}: no subcommand {word!r}")
