"""Waking an idle engine loop when a transfer thread has news.

An engine whose only work is transfers in flight runs empty steps and sleeps between them
(`IDLE_STEP_SLEEP_S`), so a pin reply or the end of a read waits for the next step: up to one
sleep on the critical path of every pull, twice. The connector's threads call `notify()` once
they posted something the engine thread must act on, and the engine sleeps in `wait()`, which
returns at once when notified and after the timeout otherwise, so a missed or absent notify
(a worker in another process, NIXL whose transfers end inside UCX) costs what the sleep did.

One event per process: a notify meant for another engine in the same process costs that engine
one empty step, nothing more.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

_event = threading.Event()


def notify() -> None:
    """Something a connector thread posted is ready for the engine thread."""
    _event.set()


def wait(timeout_s: float) -> bool:
    """Sleep up to `timeout_s`, less when notified; True when notified. The event is cleared
    before returning: whatever was posted before the notify is there for the step that follows,
    and a notify after the clear wakes the next wait."""
    woke = _event.wait(timeout_s)
    _event.clear()
    return woke


class WakingQueue(queue.Queue[Any]):
    """A queue of events for the engine thread whose put wakes it."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        super().put(item, block, timeout)
        notify()
