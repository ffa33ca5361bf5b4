"""The engine flags, defined once: `generate`, `chat`, `serve`, `profile` and `up` take theirs from
ENGINE_FLAGS and build their EngineConfig (or `LLM(...)`'s arguments) through EngineArgs. Names and
meanings are vLLM's where vLLM has the flag.

    add_engine_args(parser, "serve")                  # the flags `serve` takes, with their defaults
    engine_args = EngineArgs.from_cli_args(parser.parse_args(argv))
    config = engine_args.create_engine_config()       # ValueError naming the flag and the value

A new flag is one EngineArgs field (its default), one EngineFlag (its help and the commands that
take it) and its use: in `create_engine_config` (and `llm_kwargs` where `LLM(...)` takes it), or in
the command that reads it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvrelay import env
from kvrelay.config import (
    ATTENTION_BACKENDS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    normalize_dtype,
    normalize_kv_cache_dtype,
    parse_size,
    resolve_device,
)

ENGINE_COMMANDS = frozenset({"generate", "chat", "serve", "profile", "up"})
_ONE_INSTANCE = ENGINE_COMMANDS - {"up"}  # `up` has its own per-instance flags (--prefill-tp, ...)
_RUNS_RANKS = _ONE_INSTANCE - {"profile"}  # the profiler times one in-process engine
_MODEL_HELP = "a .gguf file or a Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)"


@dataclass(frozen=True)
class EngineArgs:
    """What the engine flags say, with their defaults. "auto" and None are resolved by the config
    or the engine for the device: on the CPU they are kvrelay's behaviour before GPUs."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    device: str = "auto"
    dtype: str = "auto"
    block_size: int = 16
    kv_cache_memory: str | None = None  # None: 512MiB on the CPU, sized from the GPU on CUDA
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None  # None: `serve` runs every rank; R: rank R alone
    enforce_eager: bool = False
    attention_backend: str = "auto"
    threads: int | None = None  # None: torch's default
    kv_transfer_config: str | None = None
    kv_events_config: str | None = None
    served_model_name: str | None = None
    enable_prefix_caching: bool = True
    chat_template: str | None = None  # a file, or the template itself
    batch_invariant: bool | None = None  # None (not given): KVRELAY_BATCH_INVARIANT decides, else off

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The engine flags of parsed `args`; a flag the command lacks, or left at None, keeps
        its default here."""
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                 if getattr(args, f.name, None) is not None}
        return cls(**given)

    def create_engine_config(self) -> EngineConfig:
        """The engine's configuration. A bad value raises ValueError naming its flag and the value,
        and a model that cannot be found FileNotFoundError, before anything is loaded."""
        from kvrelay.model.source import resolve_model_path
        resolve_model_path(self.model)
        with _naming_the_flag():
            if self.threads is not None and self.threads < 1:
                raise ValueError(f"threads must be >= 1, got {self.threads}")
            model = ModelConfig(model=self.model, dtype=self.dtype, device=resolve_device(self.device),
                                max_model_len=self.max_model_len, seed=self.seed,
                                served_model_name=self.served_model_name, enforce_eager=self.enforce_eager,
                                attention_backend=self.attention_backend,
                                chat_template=self.chat_template_text(),
                                batch_invariant=(env.batch_invariant() if self.batch_invariant is None
                                                 else self.batch_invariant))
            kv_cache_memory = None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory,
                                                                                    "kv_cache_memory")
            cache = CacheConfig(block_size=self.block_size, kv_cache_memory=kv_cache_memory,
                                gpu_memory_utilization=self.gpu_memory_utilization,
                                cache_dtype=self.kv_cache_dtype,
                                enable_prefix_caching=self.enable_prefix_caching)
            scheduler = SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                        max_num_batched_tokens=self.max_num_batched_tokens)
            parallel = self._parallel_config()
        from kvrelay.kv_events.config import KVEventsConfig
        from kvrelay.kv_transfer.config import KVTransferConfig
        try:
            kv_transfer = KVTransferConfig.from_any(self.kv_transfer_config)
        except ValueError as e:
            raise ValueError(f"argument --kv-transfer-config: {e}") from None
        try:
            kv_events = KVEventsConfig.from_any(self.kv_events_config)
        except ValueError as e:
            raise ValueError(f"argument --kv-events-config: {e}") from None
        config = EngineConfig(model=model, cache=cache, scheduler=scheduler, parallel=parallel,
                              kv_transfer=kv_transfer, kv_events=kv_events)
        return self._data_parallel(config)

    def _parallel_config(self) -> ParallelConfig:
        backend = self.distributed_executor_backend
        if self.data_parallel_size > 1 and self.data_parallel_rank is None:
            if backend == "uni":
                raise ValueError("distributed_executor_backend 'uni' runs the worker in the server's "
                                 "process, but each data-parallel rank runs in its own: drop it (or use "
                                 "'mp')")
            backend = "mp"
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              distributed_executor_backend=backend,
                              data_parallel_size=self.data_parallel_size,
                              data_parallel_rank=self.data_parallel_rank)

    @staticmethod
    def _data_parallel(config: EngineConfig) -> EngineConfig:
        """Check the whole group's KV ports (and every rank's config) now, before anything loads;
        with --data-parallel-rank, the config of that rank alone."""
        from kvrelay.kv_transfer.config import check_kv_port_range

        parallel = config.parallel
        check_kv_port_range(config.kv_transfer, parallel.tensor_parallel_size, parallel.data_parallel_size)
        rank = parallel.data_parallel_rank
        group = dataclasses.replace(config, parallel=dataclasses.replace(parallel, data_parallel_rank=None))
        rank_configs = [group.for_data_parallel_rank(r) for r in range(parallel.data_parallel_size)]
        return config if rank is None else rank_configs[rank]

    def llm_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of `LLM(...)` these flags ask for."""
        names = ("model", "device", "dtype", "block_size", "kv_cache_memory", "gpu_memory_utilization",
                 "kv_cache_dtype", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "seed",
                 "tensor_parallel_size", "distributed_executor_backend", "enforce_eager",
                 "attention_backend", "kv_transfer_config", "kv_events_config", "enable_prefix_caching",
                 "batch_invariant")
        return {**{name: getattr(self, name) for name in names}, "chat_template": self.chat_template_text()}

    def chat_template_text(self) -> str | None:
        """--chat-template as vLLM reads it: a file's text, else the value itself when it holds
        Jinja syntax; a value that looks like a path but names no file is an error, as is a
        template that does not compile."""
        if self.chat_template is None:
            return None
        path = Path(self.chat_template).expanduser()
        if path.is_file():
            text = path.read_text(encoding="utf-8")
        elif any(c in self.chat_template for c in "{}\n"):
            # "\n" typed in a shell becomes a newline; other characters stay as they are
            text = self.chat_template.encode("latin-1", "backslashreplace").decode("unicode_escape")
        else:
            raise ValueError(f"argument --chat-template: {self.chat_template!r} looks like a path, but no "
                             "such file exists; pass a template file or the template itself")
        from kvrelay.model.tokenizer import compile_chat_template
        try:
            compile_chat_template(text)
        except ValueError as e:
            raise ValueError(f"argument --chat-template: {e}") from None
        return text

    def set_torch_threads(self) -> None:
        """--threads: torch's CPU threads for this process (nothing when not given)."""
        if self.threads is not None:
            import torch
            torch.set_num_threads(self.threads)


@dataclass(frozen=True)
class EngineFlag:
    """One engine flag: `--dest-with-dashes`, its help, and the commands that take it."""

    dest: str  # the EngineArgs field
    help: str
    type: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    switch: bool = False  # a flag without a value (store_true)
    negatable: bool = False  # a switch that also has --no-... (vLLM's BooleanOptionalAction flags)
    aliases: tuple[str, ...] = ()
    commands: frozenset[str] = ENGINE_COMMANDS
    # The spelling `kvrelay up` passes on to its `kvrelay serve` children ("bf16" -> "bfloat16").
    canonical: Callable[[str], str] | None = None

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")

    @property
    def negated_option(self) -> str:
        return "--no-" + self.dest.replace("_", "-")

    @property
    def default(self) -> Any:
        return next(f.default for f in dataclasses.fields(EngineArgs) if f.name == self.dest)


ENGINE_FLAGS: tuple[EngineFlag, ...] = (
    EngineFlag("device", "where the model runs: auto (a GPU when one is visible, else the CPU), cpu, "
                         "cuda or cuda:N"),
    EngineFlag("dtype", "the model's dtype: auto (float32 on the CPU, the checkpoint's on a GPU), "
                        "float32, bfloat16 or float16", canonical=normalize_dtype),
    EngineFlag("block_size", "tokens per KV block", type=int),
    EngineFlag("kv_cache_memory", "bytes for the KV cache, e.g. 1GiB (default: 512MiB on the CPU; on a "
                                  "GPU what --gpu-memory-utilization leaves after the weights)"),
    EngineFlag("gpu_memory_utilization", "the share of the GPU's memory this instance may use, in (0, 1]",
               type=float),
    EngineFlag("kv_cache_dtype", "what the KV cache stores: auto (the model's dtype), float32, bfloat16, "
                                 "float16, fp8_e4m3 (fp8), fp8_e5m2", canonical=normalize_kv_cache_dtype),
    EngineFlag("max_num_seqs", "requests in the running batch at most", type=int),
    EngineFlag("max_num_batched_tokens", "the scheduler's token budget per step", type=int),
    EngineFlag("max_model_len", "the context length (default: the model's)", type=int),
    EngineFlag("seed", "seed of the engine's random sampling", type=int),
    EngineFlag("tensor_parallel_size", "split the model over this many worker processes, one GPU each "
                                       "on CUDA", type=int, aliases=("-tp",), commands=_RUNS_RANKS),
    EngineFlag("distributed_executor_backend", "'uni': the worker runs in this process (default at TP 1); "
                                               "'mp': one worker process per rank (default above TP 1)",
               choices=("uni", "mp"), commands=_RUNS_RANKS),
    EngineFlag("data_parallel_size", "run this many whole engines (ranks) behind this server's one endpoint, "
                                     "each in its own worker processes with its own KV cache, engine id "
                                     "<id>_dp<rank> and KV ports from kv_port + rank * tensor_parallel_size; "
                                     "with --data-parallel-rank: the size of the group that rank is one of",
               type=int, aliases=("-dp",), commands=frozenset({"serve"})),
    EngineFlag("data_parallel_rank", "run only this rank of a --data-parallel-size group (a balancer outside "
                                     "picks ranks, e.g. the kvrelay proxy or llm-d), with the same ports and "
                                     "engine id as that rank of the group", type=int, aliases=("-dpn",),
               commands=frozenset({"serve"})),
    EngineFlag("enforce_eager", "run every step eagerly: no CUDA graphs", switch=True),
    EngineFlag("attention_backend", "the attention route: auto (cpu on the CPU, triton on CUDA), cpu "
                                    "(native kernels), torch (the reference, any device), triton (CUDA)",
               choices=ATTENTION_BACKENDS),
    EngineFlag("threads", "torch CPU threads for this instance (default: torch's)", type=int,
               commands=_ONE_INSTANCE),
    EngineFlag("kv_transfer_config", "the KV connector's config as a JSON object",
               commands=frozenset({"serve"})),
    EngineFlag("kv_events_config", "publish KV cache events (vLLM's flag and keys) as a JSON object, e.g. "
                                   "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:5557\", "
                                   "\"replay_endpoint\": \"tcp://*:5558\"}' (see docs/routing.md)",
               commands=frozenset({"serve"})),
    EngineFlag("served_model_name", "the model name clients send (default: from the model)",
               commands=frozenset({"serve", "up"})),
    EngineFlag("enable_prefix_caching", "reuse the KV of a prompt's prefix cached by earlier requests "
                                        "(--no-enable-prefix-caching: compute every prompt in full)",
               switch=True, negatable=True, commands=ENGINE_COMMANDS - {"profile"}),
    EngineFlag("chat_template", "a Jinja chat template used instead of the model's own: a file, or the "
                                "template itself (vLLM's flag)", commands=ENGINE_COMMANDS - {"profile"}),
    EngineFlag("batch_invariant", "batch-invariant mode: a request's logprobs are bitwise the same whatever "
                                  "it is batched with, however its prompt is chunked or loaded, alone or "
                                  "through P/D (costs speed; docs/batch_invariance.md). Env: "
                                  "KVRELAY_BATCH_INVARIANT=1", switch=True),
)
_FLAG_OF_DEST = {flag.dest: flag for flag in ENGINE_FLAGS}


def flags_of(command: str) -> tuple[EngineFlag, ...]:
    """The engine flags `command` takes, in ENGINE_FLAGS' order."""
    if command not in ENGINE_COMMANDS:
        raise ValueError(f"unknown command {command!r}: one of {', '.join(sorted(ENGINE_COMMANDS))}")
    return tuple(flag for flag in ENGINE_FLAGS if command in flag.commands)


def add_engine_args(parser: argparse.ArgumentParser, command: str,
                    model: Literal["positional", "flag"] = "positional", defaults: bool = True,
                    title: str = "engine", description: str | None = None) -> None:
    """Add the model argument and `command`'s engine flags to `parser`, in a group `title`.
    `model="flag"`: `--model` (a command whose positional is something else). `defaults=False`:
    every flag defaults to None, "not given" (`kvrelay up` passes on only what was given)."""
    if model == "positional":
        parser.add_argument("model", nargs="?", default=None, help=_MODEL_HELP)
    else:
        parser.add_argument("--model", default=None, help=_MODEL_HELP)
    group = parser.add_argument_group(title, description)
    for flag in flags_of(command):
        default = flag.default if defaults else None
        shown = default is not None and default is not False
        help_text = f"{flag.help} (default: {default})" if shown else flag.help
        if flag.negatable:  # default None for `up`: neither given, serve's default stays
            group.add_argument(flag.option, dest=flag.dest, action="store_true", default=default,
                               help=f"{flag.help} (default: {'on' if flag.default else 'off'})")
            group.add_argument(flag.negated_option, dest=flag.dest, action="store_false",
                               help=argparse.SUPPRESS)
        elif flag.switch:
            group.add_argument(flag.option, *flag.aliases, dest=flag.dest, action="store_true",
                               default=default, help=help_text)
        else:
            group.add_argument(flag.option, *flag.aliases, dest=flag.dest, type=flag.type,
                               choices=flag.choices, default=default, help=help_text)


def given_engine_argv(args: argparse.Namespace, command: str, skip: Sequence[str] = ()) -> list[str]:
    """`command`'s engine flags that `args` holds a value for (not None, not False), as `kvrelay
    serve` arguments in canonical spelling; `skip` names dests left out."""
    argv: list[str] = []
    for flag in flags_of(command):
        value = getattr(args, flag.dest, None)
        if flag.negatable and value is False and flag.dest not in skip:
            argv.append(flag.negated_option)
            continue
        if flag.dest in skip or value is None or value is False:
            continue
        if flag.switch:
            argv.append(flag.option)
        else:
            argv += [flag.option, flag.canonical(value) if flag.canonical else str(value)]
    return argv


@contextlib.contextmanager
def _naming_the_flag() -> Iterator[None]:
    """Prefix a config error with its flag. NOTE: relies on config.py's habit of starting every
    error with the field's name (`gpu_memory_utilization must be in (0, 1], got 1.5`), which is the
    flag's dest; an error that starts otherwise passes through as it is."""
    try:
        yield
    except ValueError as e:
        leading = re.match(r"\w*", str(e))
        flag = _FLAG_OF_DEST.get(leading.group() if leading else "")
        if flag is None:
            raise
        raise ValueError(f"argument {'/'.join((flag.option, *flag.aliases))}: {e}") from None
