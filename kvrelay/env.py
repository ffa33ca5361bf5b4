"""The only place kvrelay reads environment variables.

Every variable is read through a typed accessor, at call time (not at import time), so a test can
monkeypatch the environment. Keep this list short; configuration belongs in `kvrelay.config`.

| variable            | default            | meaning                                            |
|---------------------|--------------------|----------------------------------------------------|
| `KVRELAY_CACHE_DIR` | `~/.cache/kvrelay` | converted models (`models/`) and other disk caches |
| `KVRELAY_API_KEY`   | unset              | key `kvrelay serve` requires as `Authorization: Bearer` |
| `KVRELAY_KV_SECRET` | unset              | P/D cluster secret (>= 16 chars); `secret_file` wins |
| `KVRELAY_ADMIN_KEY` | unset              | key of the proxy's admin API (`kvrelay proxy`, `kvrelay pool`) |
| `KVRELAY_NATIVE_KERNELS` | `1`           | `0`: never compile/use the native C kernels        |
| `KVRELAY_NATIVE_ARCH` | `native`         | their build target: `native`, `haswell` (AVX2) or `generic` |
| `KVRELAY_BATCH_INVARIANT` | `0`          | `1`: the batch-invariant mode (`--batch-invariant`) by default |

Read as huggingface_hub reads them, to find a repo id in the local Hugging Face cache (kvrelay never
downloads): `HF_HUB_CACHE`, else `HF_HOME/hub`, else `XDG_CACHE_HOME/huggingface/hub`, else
`~/.cache/huggingface/hub`.
"""

from __future__ import annotations

import os
from pathlib import Path

_DEFAULT_CACHE_DIR = "~/.cache/kvrelay"
NATIVE_ARCHS = ("native", "haswell", "generic")  # see kvrelay/kernels/native.py


def cache_dir() -> Path:
    """Root of kvrelay's disk caches (`KVRELAY_CACHE_DIR`), with `~` expanded."""
    raw = os.environ.get("KVRELAY_CACHE_DIR") or _DEFAULT_CACHE_DIR
    return Path(raw).expanduser()


def api_key() -> str | None:
    """The key `kvrelay serve` requires when `--api-key` is not given (`KVRELAY_API_KEY`), or None."""
    return os.environ.get("KVRELAY_API_KEY") or None


def admin_key() -> str | None:
    """The key of the proxy's admin API when `--admin-key` is not given (`KVRELAY_ADMIN_KEY`), or None."""
    return os.environ.get("KVRELAY_ADMIN_KEY") or None


def kv_secret() -> str | None:
    """The KV transfer secret shared by a P/D cluster (`KVRELAY_KV_SECRET`), or None."""
    return os.environ.get("KVRELAY_KV_SECRET") or None


def native_kernels() -> bool:
    """Whether kvrelay may compile and use its native CPU kernels (`KVRELAY_NATIVE_KERNELS`, default on)."""
    return os.environ.get("KVRELAY_NATIVE_KERNELS", "1").strip().lower() not in ("0", "false", "no", "off")


def native_arch() -> str:
    """The native kernels' build target (`KVRELAY_NATIVE_ARCH`, default `native`): one of NATIVE_ARCHS."""
    raw = os.environ.get("KVRELAY_NATIVE_ARCH", "").strip().lower() or "native"
    if raw not in NATIVE_ARCHS:
        raise ValueError(f"KVRELAY_NATIVE_ARCH must be one of {', '.join(NATIVE_ARCHS)}, got {raw!r}")
    return raw


def hf_hub_cache() -> Path:
    """The local Hugging Face cache of model repos, where huggingface_hub puts downloads."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"
def batch_invariant() -> bool:
    """Whether engines run the batch-invariant mode when `--batch-invariant` / `LLM(batch_invariant=)`
    does not say (`KVRELAY_BATCH_INVARIANT`, default off; vLLM's `VLLM_BATCH_INVARIANT`)."""
    raw = os.environ.get("KVRELAY_BATCH_INVARIANT", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"KVRELAY_BATCH_INVARIANT must be 1 or 0, got {raw!r}")
