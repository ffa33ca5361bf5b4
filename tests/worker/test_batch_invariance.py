"""The batch-invariant mode at start (kvrelay/worker/batch_invariance.py): what it refuses, naming
why; its numerics identity, which goes into the KV compatibility fingerprint (the other build
target of the native kernels gives another, so such a P and D refuse each other); its CUDA
settings; and how it is switched on (flag, LLM argument, environment)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from kvrelay import LLM
from kvrelay.config import EngineConfig, ModelConfig, ParallelConfig
from kvrelay.entrypoints.cli import build_parser, main
from kvrelay.entrypoints.engine_args import EngineArgs
from kvrelay.kv_transfer.compat import describe_difference
from kvrelay.model.spec import ModelSpec
from kvrelay.worker import batch_invariance
from tests.kernels.builds import skip_unless_runnable
from tests.tiny import hf_config, tiny_loaded_model
from tests.tiny_mla import tiny_mla_model

ON = EngineConfig(model=ModelConfig(device="cpu", batch_invariant=True))


def llama_spec() -> ModelSpec:
    return ModelSpec.from_hf_config(hf_config("llama").to_dict())


def test_outside_the_mode_the_numerics_are_default_whatever_the_machine() -> None:
    assert batch_invariance.numerics(EngineConfig(model=ModelConfig(device="cpu"))) == "default"


def test_in_the_mode_the_numerics_name_what_decides_the_bits() -> None:
    numerics = batch_invariance.numerics(ON)
    for part in ("batch-invariant-v1", "tp1", "float32", "attention cpu rows", "-lane ", "src ",
                 f"torch {torch.__version__} {torch.backends.cpu.get_cpu_capability()}"):
        assert part in numerics, (part, numerics)


def test_the_avx2_build_has_other_numerics_so_such_a_p_and_d_refuse_each_other(
        monkeypatch: pytest.MonkeyPatch) -> None:
    skip_unless_runnable("haswell")
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", "native")
    native = batch_invariance.numerics(ON)
    monkeypatch.setenv("KVRELAY_NATIVE_ARCH", "haswell")
    avx2 = batch_invariance.numerics(ON)
    assert "kernels 8-lane fma" in avx2 and native != avx2
    why = describe_difference({"numerics": native}, {"numerics": avx2})
    assert why is not None and why.startswith("numerics differs") and "--batch-invariant" in why
    tp2 = batch_invariance.numerics(dataclasses.replace(ON, parallel=ParallelConfig(tensor_parallel_size=2)))
    assert "tp2" in tp2 and tp2 != native  # another TP size sums the row-parallel layers otherwise


@pytest.mark.parametrize(("config", "spec", "message"), [
    (dataclasses.replace(ON, parallel=ParallelConfig(tensor_parallel_size=3)), llama_spec(),
     "tensor_parallel_size up to 2, got 3"),
    (ON, tiny_mla_model().spec, "latent attention"),
])
def test_what_the_mode_cannot_do_is_refused_naming_why(config: EngineConfig, spec: ModelSpec,
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        batch_invariance.check_supported(config, spec)
    batch_invariance.check_supported(dataclasses.replace(config, model=ModelConfig(device="cpu")), spec)


def test_without_the_native_kernels_the_mode_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVRELAY_NATIVE_KERNELS", "0")
    with pytest.raises(ValueError, match="needs the native kernels, unavailable here: KVRELAY_NATIVE"):
        LLM(loaded_model=tiny_loaded_model(), num_blocks=16, batch_invariant=True)


def test_a_gpu_older_than_hopper_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    config = EngineConfig(model=dataclasses.replace(ON.model, device="cpu"))
    object.__setattr__(config.model, "device", "cuda")  # no GPU here: only the check is run
    with pytest.raises(ValueError, match=r"compute capability \(9, 0\) or newer.*has \(8, 0\)"):
        batch_invariance.check_supported(config, llama_spec())


def test_configure_cuda_turns_off_split_k_tf32_and_reduced_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    matmul = torch.backends.cuda.matmul
    saved = (matmul.allow_fp16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction,
             matmul.fp32_precision)
    libraries: list[str] = []
    monkeypatch.setattr(torch.backends.cuda, "preferred_blas_library", libraries.append)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.delenv("CUBLASLT_WORKSPACE_SIZE", raising=False)
    try:
        batch_invariance.configure_cuda.__wrapped__()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
        assert os.environ["CUBLASLT_WORKSPACE_SIZE"] == "1"
        assert not matmul.allow_fp16_reduced_precision_reduction
        assert not matmul.allow_bf16_reduced_precision_reduction
        assert matmul.fp32_precision == "ieee" and libraries == ["cublaslt"]
    finally:
        matmul.allow_fp16_reduced_precision_reduction = saved[0]
        matmul.allow_bf16_reduced_precision_reduction = saved[1]
        matmul.fp32_precision = saved[2]


@pytest.mark.parametrize(("changes", "message"), [
    ({"attention_backend": "torch"}, "the torch route prefills"),
    ({"dtype": "bfloat16"}, "use --dtype float32"),
    ({"batch_invariant": "yes"}, "batch_invariant must be true or false"),
])
def test_a_config_the_mode_cannot_run_is_refused_before_the_model_loads(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{"device": "cpu", "batch_invariant": True, **changes})


def test_the_flag_the_llm_argument_and_the_environment_switch_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    def parsed(*argv: str) -> bool:
        args = EngineArgs.from_cli_args(build_parser().parse_args(["serve", "--device", "cpu", *argv]))
        return args.create_engine_config().model.batch_invariant

    monkeypatch.delenv("KVRELAY_BATCH_INVARIANT", raising=False)
    assert not parsed() and parsed("--batch-invariant")
    for command in ("generate", "chat", "profile", "up"):
        argv = [command, *(["a prompt"] if command == "generate" else []), "--batch-invariant"]
        assert EngineArgs.from_cli_args(build_parser().parse_args(argv)).batch_invariant
    monkeypatch.setenv("KVRELAY_BATCH_INVARIANT", "1")
    assert parsed()
    with LLM(loaded_model=tiny_loaded_model(), num_blocks=16) as llm:
        assert llm.engine.config.model.batch_invariant
        assert llm.engine.kv.fingerprint["numerics"].startswith("batch-invariant-v1")
    with LLM(loaded_model=tiny_loaded_model(), num_blocks=16, batch_invariant=False) as llm:
        assert "numerics" not in llm.engine.kv.fingerprint  # the default: as before the field existed
    monkeypatch.setenv("KVRELAY_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="KVRELAY_BATCH_INVARIANT must be 1 or 0, got 'maybe'"):
        parsed()


def test_up_passes_the_flag_to_every_instance() -> None:
    from kvrelay.disagg.launcher_cli import serve_args_of

    assert "--batch-invariant" in serve_args_of(build_parser().parse_args(["up", "--batch-invariant"]))
    assert "--batch-invariant" not in serve_args_of(build_parser().parse_args(["up"]))


def test_a_flag_combination_the_mode_cannot_run_exits_2_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--device", "cpu", "--batch-invariant", "--attention-backend", "torch"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrelay: error: argument --batch-invariant:") and "torch route" in err, err
