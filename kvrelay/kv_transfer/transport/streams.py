"""A side stream for copies off the compute stream, and the events that say they ran: CUDA's on
a GPU; on the CPU copies finish before they return and an event is done at once (or after
`delay_s`, a test's slow copy)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Protocol


class CopyEvent(Protocol):
    """Marks the end of the copies queued before it; `query` is True once they all ran."""

    def query(self) -> bool: ...


class _Done:
    def __init__(self, delay_s: float) -> None:
        self.ready_at = time.monotonic() + delay_s

    def query(self) -> bool:
        return time.monotonic() >= self.ready_at


@contextlib.contextmanager
def _no_stream() -> Iterator[None]:
    yield


class SideStream:
    """Copies issued inside `copying()` run off the compute stream; `record()` marks them."""

    def __init__(self, device: str, delay_s: float = 0.0) -> None:
        self.device = device
        self.delay_s = delay_s  # CPU only: how long each event takes to report done
        self._last_ready_at = 0.0  # CPU only: when the last recorded event reports done
        self._stream = None
        if device.startswith("cuda"):
            import torch

            self._stream = torch.cuda.Stream(torch.device(device))

    def copying(self) -> contextlib.AbstractContextManager[None]:
        if self._stream is None:
            return _no_stream()
        import torch

        # NOTE: waits for the compute stream's work queued so far (the blocks' last writes),
        # nothing queued later: the compute stream goes on while the copies run.
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        return torch.cuda.stream(self._stream)  # type: ignore[return-value]

    def record(self) -> CopyEvent:
        if self._stream is None:
            done = _Done(self.delay_s)
            self._last_ready_at = max(self._last_ready_at, done.ready_at)
            return done
        import torch

        event = torch.cuda.Event()
        event.record(self._stream)
        return event

    def synchronize(self) -> None:
        """Block until every copy issued so far ran (on the CPU: until the last event is done)."""
        if self._stream is not None:
            self._stream.synchronize()
            return
        time.sleep(max(0.0, self._last_ready_at - time.monotonic()))

    def wait(self, event: CopyEvent, timeout_s: float) -> bool:
        """Poll `event` until it is done (True) or `timeout_s` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while not event.query():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.0002)
        return True
