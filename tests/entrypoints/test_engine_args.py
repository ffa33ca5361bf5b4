"""The engine flags, defined once (kvrelay/entrypoints/engine_args.py): every command that takes a
flag parses it the same way, builds the config it asks for, and refuses a bad value naming the flag.

No test needs a GPU: torch.cuda is patched to show none or some.
"""

from __future__ import annotations

import argparse
import inspect
import signal
import subprocess
import sys

import pytest
import torch

from kvrelay.config import EngineConfig
from kvrelay.disagg.launcher_cli import serve_args_of
from kvrelay.engine.llm import LLM
from kvrelay.entrypoints.cli import build_parser, main
from kvrelay.entrypoints.engine_args import ENGINE_FLAGS, EngineArgs, flags_of
from kvrelay.entrypoints.serve_cli import build_engine_config
from kvrelay.sampling_params import SamplingParams

# What each command needs before its engine flags (generate's positional is the prompt).
COMMAND_PREFIX = {"generate": ["generate", "a prompt"], "chat": ["chat"], "serve": ["serve"],
                  "profile": ["profile"], "up": ["up"]}
SHARED_FLAGS = ["--device", "cpu", "--dtype", "bf16", "--block-size", "32", "--kv-cache-memory", "8MiB",
                "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "fp8", "--max-num-seqs", "8",
                "--max-num-batched-tokens", "256", "--max-model-len", "512", "--seed", "3",
                "--enforce-eager", "--attention-backend", "torch"]


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def parse(command: str, *flags: str) -> EngineArgs:
    return EngineArgs.from_cli_args(build_parser().parse_args([*COMMAND_PREFIX[command], *flags]))


def test_the_shared_flags_parse_identically_for_every_command() -> None:
    parsed = {command: parse(command, *SHARED_FLAGS) for command in COMMAND_PREFIX}
    assert parsed["serve"].dtype == "bf16" and parsed["serve"].enforce_eager
    assert all(args == parsed["serve"] for args in parsed.values()), parsed


def test_each_command_has_exactly_the_flags_it_takes() -> None:
    for command, prefix in COMMAND_PREFIX.items():
        dests = {action.dest for action in _subparser(prefix[0])._actions}
        for flag in ENGINE_FLAGS:
            assert (flag.dest in dests) == (command in flag.commands), (command, flag.dest)
    assert {f.dest for f in flags_of("serve")} >= {"kv_transfer_config", "served_model_name", "threads"}
    assert "threads" not in {f.dest for f in flags_of("up")}  # up has --threads-per-instance
    assert "tensor_parallel_size" not in {f.dest for f in flags_of("profile")}


def test_generate_takes_the_model_as_a_flag_and_the_others_as_the_positional() -> None:
    assert parse("generate", "--model", "m.gguf").model == "m.gguf"
    for command in ("chat", "serve", "profile", "up"):
        assert EngineArgs.from_cli_args(build_parser().parse_args([command, "m.gguf"])).model == "m.gguf"


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "profile"])
def test_without_flags_a_cpu_machine_gets_the_defaults_of_before(command: str, no_gpu: None) -> None:
    config = parse(command).create_engine_config()
    assert (config.model.device, config.model.dtype, config.model.seed) == ("cpu", "float32", 0)
    assert config.cache.kv_cache_memory is None  # the worker's CPU default: 512MiB, as before
    assert (config.cache.block_size, config.cache.cache_dtype) == (16, "auto")
    assert (config.scheduler.max_num_seqs, config.scheduler.max_num_batched_tokens) == (64, 2048)
    assert (config.parallel.tensor_parallel_size, config.parallel.distributed_executor_backend) == (1, "uni")
    assert not config.model.enforce_eager and config.model.attention_backend == "auto"


def test_serve_builds_the_config_its_flags_ask_for(no_gpu: None) -> None:
    args = build_parser().parse_args(["serve", "--device", "cpu", "--dtype", "bf16",
                                      "--gpu-memory-utilization", "0.5", "--enforce-eager",
                                      "--attention-backend", "torch", "--kv-cache-memory", "1GiB",
                                      "--max-model-len", "256", "--served-model-name", "mine",
                                      "--threads", "2"])
    config = build_engine_config(args)
    assert isinstance(config, EngineConfig)
    assert (config.model.device, config.model.dtype, config.model.enforce_eager) == ("cpu", "bfloat16", True)
    assert (config.model.attention_backend, config.model.max_model_len) == ("torch", 256)
    assert config.model.served_model_name == "mine"
    assert (config.cache.gpu_memory_utilization, config.cache.kv_cache_memory) == (0.5, 1024**3)
    assert config.kv_transfer is None


def test_serve_on_a_gpu_leaves_dtype_auto_for_the_checkpoint_and_sizes_the_cache_from_it(
        one_gpu: None) -> None:
    config = parse("serve", "--device", "cuda", "-tp", "1").create_engine_config()
    assert (config.model.device, config.model.dtype, config.cache.kv_cache_memory) == ("cuda", "auto", None)
    assert parse("serve").create_engine_config().model.device == "cuda"  # auto: the GPU it sees


def test_serve_takes_a_kv_transfer_config() -> None:
    config = parse("serve", "--device", "cpu", "--kv-transfer-config",
                   '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}').create_engine_config()
    assert config.kv_transfer is not None and config.kv_transfer.kv_connector == "ExampleConnector"


def test_generate_and_chat_flags_are_llm_keyword_arguments() -> None:
    kwargs = parse("generate", *SHARED_FLAGS, "-tp", "2").llm_kwargs()
    inspect.signature(LLM).bind(**kwargs)  # every one is a parameter of LLM(...)
    assert (kwargs["device"], kwargs["gpu_memory_utilization"], kwargs["enforce_eager"]) == ("cpu", 0.5, True)
    assert (kwargs["attention_backend"], kwargs["tensor_parallel_size"]) == ("torch", 2)
    defaults = {name: p.default for name, p in inspect.signature(LLM).parameters.items()}
    for name, value in parse("chat").llm_kwargs().items():  # the flags' defaults are LLM's
        assert defaults[name] == value, name


def test_llm_takes_vllms_names_into_its_config() -> None:
    from tests.tiny import tiny_loaded_model

    with LLM(device="cpu", dtype="auto", kv_cache_memory="4MiB", gpu_memory_utilization=0.5,
             enforce_eager=True, attention_backend="auto", loaded_model=tiny_loaded_model()) as llm:
        config = llm.engine.config
        assert (config.model.device, config.model.dtype) == ("cpu", "float32")
        assert config.model.enforce_eager
        assert (config.cache.gpu_memory_utilization, config.cache.kv_cache_memory) == (0.5, 4 * 1024**2)


def test_up_passes_on_only_the_engine_flags_given_and_serve_reads_them_back(no_gpu: None) -> None:
    assert serve_args_of(build_parser().parse_args(["up"])) == []
    up = build_parser().parse_args(["up", *SHARED_FLAGS, "--served-model-name", "mine"])
    forwarded = serve_args_of(up)
    assert "--device" not in forwarded and "--gpu-memory-utilization" not in forwarded  # per instance
    assert forwarded[forwarded.index("--dtype") + 1] == "bfloat16"  # canonical spellings
    served = parse("serve", *forwarded, "--device", "cpu", "--gpu-memory-utilization", "0.5")
    expected = EngineArgs.from_cli_args(up)
    assert served.create_engine_config() == expected.create_engine_config()


@pytest.mark.parametrize("argv, words", [
    (["serve", "--gpu-memory-utilization", "1.5"], ["argument --gpu-memory-utilization", "got 1.5"]),
    (["serve", "--gpu-memory-utilization", "0"], ["argument --gpu-memory-utilization", "got 0.0"]),
    (["serve", "--device", "tpu"], ["argument --device", "got 'tpu'"]),
    (["serve", "--device", "cuda"], ["argument --device", "asks for a GPU", "use --device cpu"]),
    (["serve", "--device", "cuda:1"], ["argument --device", "asks for a GPU"]),
    (["serve", "--block-size", "0"], ["argument --block-size", "got 0"]),
    (["serve", "--kv-transfer-config", "{oops"], ["argument --kv-transfer-config", "not valid JSON"]),
    (["serve", "--kv-transfer-config", '{"kv_role": "boss"}'], ["argument --kv-transfer-config", "'boss'"]),
    (["serve", "-tp", "2", "--distributed-executor-backend", "uni"],
     ["argument --distributed-executor-backend", "tensor_parallel_size=2"]),
    (["serve", "--threads", "0"], ["argument --threads", "got 0"]),
    (["generate", "hi", "--dtype", "int8"], ["argument --dtype", "got 'int8'"]),
    (["generate", "hi", "--max-model-len", "-4"], ["argument --max-model-len", "got -4"]),
    (["chat", "--kv-cache-memory", "lots"], ["argument --kv-cache-memory", "'lots'"]),
    (["chat", "--kv-cache-dtype", "int4"], ["argument --kv-cache-dtype", "got 'int4'"]),
    (["profile", "--max-num-seqs", "0"], ["argument --max-num-seqs", "got 0"]),
    (["profile", "--device", "cuda"], ["argument --device", "asks for a GPU"]),
    (["up", "--device", "cuda"], ["argument --device", "asks for a GPU"]),
    (["up", "--gpu-memory-utilization", "2"], ["argument --gpu-memory-utilization", "got 2.0"]),
    (["up", "--kv-cache-dtype", "fp7"], ["argument --kv-cache-dtype", "got 'fp7'"]),
])
def test_a_bad_value_exits_2_naming_the_flag_and_the_value(argv: list[str], words: list[str], no_gpu: None,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrelay: error: argument --") and all(w in err for w in words), err


def test_the_triton_backend_without_a_gpu_is_refused_naming_the_flag(
        no_gpu: None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert main(["serve", "--attention-backend", "triton"]) == 2
    err = capsys.readouterr().err
    assert "argument --attention-backend: attention_backend 'triton' needs a CUDA device" in err


def test_the_cpu_backend_on_a_gpu_is_refused_naming_the_flag(one_gpu: None,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "cuda:0", "--attention-backend", "cpu"]) == 2
    assert "argument --attention-backend" in capsys.readouterr().err
    assert main(["serve", "--device", "cuda:1"]) == 2
    assert "this machine has 1 GPU(s)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, flag", [
    (["serve", "--attention-backend", "flash"], "--attention-backend"),
    (["chat", "--gpu-memory-utilization", "most"], "--gpu-memory-utilization"),
    (["up", "--max-num-seqs", "many"], "--max-num-seqs"),
])
def test_a_value_of_the_wrong_kind_is_argparses_exit_2_naming_the_flag(
        argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and f"argument {flag}" in capsys.readouterr().err


def test_up_places_its_instances_before_starting_anything(one_gpu: None, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from kvrelay.disagg.launcher import LocalCluster

    assert main(["up", "--device", "cuda", "--prefill-tp", "2"]) == 2  # one GPU for two ranks
    assert "prefill-0 has tensor-parallel size 2" in capsys.readouterr().err

    def interrupted(self: LocalCluster) -> None:
        raise KeyboardInterrupt
    monkeypatch.setattr(LocalCluster, "start", interrupted)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["up", "--gpu-memory-utilization", "0.8"]) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = capsys.readouterr().out
    assert "prefill-0    on GPU 0, gpu-memory-utilization 0.4" in out
    assert "decode-0     on GPU 0, gpu-memory-utilization 0.4" in out


def test_a_cuda_device_this_machine_lacks_is_refused_at_start_without_a_traceback() -> None:
    done = subprocess.run([sys.executable, "-m", "kvrelay.entrypoints.cli", "serve", "--device", "cuda:64"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "kvrelay: error: argument --device: device 'cuda:64'" in done.stderr
    assert "Traceback" not in done.stderr


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser: argparse.ArgumentParser = sub.choices[command]
    return parser


@pytest.mark.parametrize("command", ["generate", "chat", "serve", "up"])
def test_prefix_caching_is_on_unless_no_enable_prefix_caching_says_otherwise(command: str,
                                                                             no_gpu: None) -> None:
    assert parse(command).create_engine_config().cache.enable_prefix_caching
    assert parse(command, "--enable-prefix-caching").create_engine_config().cache.enable_prefix_caching
    off = parse(command, "--no-enable-prefix-caching")
    assert not off.create_engine_config().cache.enable_prefix_caching
    if command in ("generate", "chat"):
        assert off.llm_kwargs()["enable_prefix_caching"] is False
    up = build_parser().parse_args(["up", "--no-enable-prefix-caching"])
    assert serve_args_of(up) == ["--no-enable-prefix-caching"]  # `up` passes it on as given
    assert serve_args_of(build_parser().parse_args(["up"])) == []


def test_chat_template_is_a_file_or_the_template_and_reaches_the_engine(
        tmp_path, no_gpu: None, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.tiny import tiny_loaded_model

    template = "{% for m in messages %}t9 {{ m['content'] }} t7 {% endfor %}t8"
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    for value in (str(path), template):
        config = parse("serve", "--chat-template", value).create_engine_config()
        assert config.model.chat_template == template
    assert serve_args_of(build_parser().parse_args(["up", "--chat-template", str(path)])) == [
        "--chat-template", str(path)]
    kwargs = parse("chat", "--chat-template", str(path)).llm_kwargs()
    with LLM(loaded_model=tiny_loaded_model(), num_blocks=16, block_size=4,
             chat_template=kwargs["chat_template"]) as llm:
        text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "t5 t6"}])
        assert text == "t9 t5 t6 t7 t8"
        out = llm.chat([{"role": "user", "content": "t5"}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert out[0].prompt_token_ids == [9, 5, 7, 8]
    bad_values = ((str(tmp_path / "missing.jinja"), "looks like a path"), ("{% if %}", "not valid Jinja"))
    for bad, words in bad_values:
        assert main(["serve", "--chat-template", bad]) == 2
        err = capsys.readouterr().err
        assert "argument --chat-template" in err and words in err, err
