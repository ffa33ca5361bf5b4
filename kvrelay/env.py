"""The only place kvrelay reads environment variables.

Every variable is read through a typed accessor, at call time (not at import time), so a test can
monkeypatch the environment. Keep this list short; configuration belongs in `kvrelay.config`.

| variable            | default            | meaning                                            |
|---------------------|--------------------|----------------------------------------------------|
| `KVRELAY_CACHE_DIR` | `~/.cache/kvrelay` | converted models (`models/`) and other disk caches |
"""

from __future__ import annotations

import os
from pathlib import Path

_DEFAULT_CACHE_DIR = "~/.cache/kvrelay"


def cache_dir() -> Path:
    """Root of kvrelay's disk caches (`KVRELAY_CACHE_DIR`), with `~` expanded."""
    raw = os.environ.get("KVRELAY_CACHE_DIR") or _DEFAULT_CACHE_DIR
    return Path(raw).expanduser()
