"""`kvrelay up`'s working directory: one temporary directory per cluster, removed when it stops.

It holds the children's logs (unless --log-dir says otherwise), the KV event sockets (ipc://) and
whatever a connector plan needs on disk. A launcher killed outright (`kill -9`) cannot remove it,
so each directory names its owner (pid and process start time) and the next `kvrelay up` removes
every directory whose owner is gone. The logs of a start that failed are moved out first
(`keep_logs`), to a directory no launcher removes, so the error can point at them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "kvrelay-up-"
KEPT_LOGS_PREFIX = "kvrelay-logs-"  # not PREFIX: kept logs outlive their launcher on purpose
OWNER_FILE = "owner"


def make_workdir(root: Path | None = None) -> Path:
    """A fresh working directory owned by this process, after removing stale ones in `root`
    (default: the system's temporary directory)."""
    root = Path(root or tempfile.gettempdir())
    remove_stale_workdirs(root)
    path = Path(tempfile.mkdtemp(prefix=PREFIX, dir=root))
    (path / OWNER_FILE).write_text(process_identity(os.getpid()) or "")
    return path


def process_identity(pid: int) -> str | None:
    """"pid start-time" of a live process (the start time tells a reused pid apart); None when no
    such process runs. Without /proc, the pid alone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:
        return _pid_alone(pid)
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # a zombie: gone, only not reaped yet
        return None
    return f"{pid} {fields[19]}"  # field 22 of stat: the start time, in clock ticks since boot


def _pid_alone(pid: int) -> str | None:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return str(pid)


def remove_stale_workdirs(root: Path) -> list[Path]:
    """Remove the working directories in `root` whose launcher no longer runs; the ones removed.
    A directory without an owner file (being made right now, or not ours) is left alone."""
    removed = []
    for path in sorted(root.glob(PREFIX + "*")):
        try:
            owner = (path / OWNER_FILE).read_text().strip()
        except OSError:
            continue
        pid = owner.split()[0] if owner else ""
        if not pid.isdigit() or process_identity(int(pid)) == owner:
            continue
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed %s, left by a kvrelay up (pid %s) that did not stop cleanly", path, pid)
        removed.append(path)
    return removed


def keep_logs(log_dir: Path, root: Path | None = None) -> Path | None:
    """Move the *.log files of `log_dir` to a new directory in `root` (default: the system's
    temporary directory) that outlives the cluster; None when there were none."""
    logs = sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []
    if not logs:
        return None
    kept = Path(tempfile.mkdtemp(prefix=KEPT_LOGS_PREFIX, dir=root))
    for log in logs:
        with contextlib.suppress(OSError):
            shutil.move(str(log), kept / log.name)
    return kept
