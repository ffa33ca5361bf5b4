"""Which model a vLLM instance runs, named the way kvrelay names it in the compatibility digest.

kvrelay's model fingerprint (kvrelay/worker/kv_setup.py `model_fingerprint`) is the architecture
and shapes plus a digest of the first elements of every weight. A vLLM instance whose model is a
local Hugging Face directory of safetensors that kvrelay can read gets the same fingerprint as a
kvrelay instance running the same weights, so the two can exchange KV (the mixed fleet); only
the first rows of each tensor are read, through the safetensors header, never the whole file.

Any other model (an architecture kvrelay does not run, a hub name, other weight formats) is named
from vLLM's config: architecture, shapes, name and revision. Two vLLM instances of it still pair
with each other; a kvrelay instance never does.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SAMPLE = 64  # elements per weight: the same sample kvrelay's model_fingerprint takes


def model_identity(model_config: Any) -> str:
    """kvrelay's model fingerprint of the model vLLM's `model_config` names (see module doc)."""
    directory = Path(str(model_config.model))
    if (directory / "config.json").is_file():
        try:
            return _kvrelay_fingerprint(directory)
        except (ValueError, KeyError, OSError) as e:
            logger.info("kvrelay: %s is not a model kvrelay reads (%s); naming it from vLLM's config, so "
                        "only vLLM instances of it exchange KV with this one", directory, e)
    return _vllm_identity(model_config)


def _kvrelay_fingerprint(directory: Path) -> str:
    from kvrelay.model.spec import ModelSpec
    from kvrelay.worker.kv_setup import model_fingerprint

    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    spec = ModelSpec.from_hf_config(config)
    return model_fingerprint(spec, sampled_weights(directory))


def sampled_weights(directory: Path) -> dict[str, Any]:
    """Every weight of a safetensors directory, cut to the rows that hold its first _SAMPLE
    elements (what model_fingerprint reads)."""
    from safetensors import safe_open

    from kvrelay.model.loader import hf_weight_files

    weights: dict[str, Any] = {}
    for file in hf_weight_files(directory):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a dict
                part = f.get_slice(name)
                shape = part.get_shape()
                row = math.prod(shape[1:]) if len(shape) > 1 else 1
                weights[name] = part[:math.ceil(_SAMPLE / max(row, 1))] if shape else part[:]
    return weights


def _vllm_identity(model_config: Any) -> str:
    hf = getattr(model_config, "hf_config", None)
    arch = ",".join(getattr(hf, "architectures", None) or ["unknown"])
    shapes = "/".join(f"{key}{getattr(hf, attr, '?')}" for key, attr in (
        ("L", "num_hidden_layers"), ("h", "hidden_size"), ("H", "num_attention_heads"), ("v", "vocab_size")))
    return f"vllm:{arch}/{shapes}/{model_config.model}@{getattr(model_config, 'revision', None) or 'main'}"
