"""The benchmarks' --plot output: matplotlib is optional (pip install 'kvrelay[bench]')."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pyplot(path: Path) -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None (said once) when not installed."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot ({path}); pip install 'kvrelay[bench]'")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(plt: Any, fig: Any, title: str, path: Path) -> None:
    """Title the figure, write it to `path` (creating its folder) and release it."""
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")
