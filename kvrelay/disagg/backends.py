"""Backend pools for the P/D proxy: which instance gets the next leg.

A pool picks its least-loaded backend, where load is the number of legs the proxy has in flight
to it. Ties go round-robin, so an idle cluster still spreads requests over every instance.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass
class Backend:
    """One `kvrelay serve` (or vLLM) instance, as the proxy sees it."""

    url: str  # base URL without a trailing slash, e.g. "http://127.0.0.1:8100"
    in_flight: int = 0


class BackendPool:
    """The prefill or the decode instances; `lease()` picks one and counts the leg in flight."""

    def __init__(self, name: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"the {name} pool needs at least one backend URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{name} backend URL must start with http:// or https://, got {url!r}")
        self.name = name
        self.backends = [Backend(url.rstrip("/")) for url in urls]
        self._turn = itertools.count()

    def pick(self) -> Backend:
        """The backend with the fewest legs in flight; round-robin among equals."""
        start = next(self._turn) % len(self.backends)
        rotated = self.backends[start:] + self.backends[:start]
        return min(rotated, key=lambda b: b.in_flight)  # min() keeps the first of equals

    def acquire(self) -> Backend:
        """Pick a backend and count one leg in flight on it; pair with `release`."""
        backend = self.pick()
        backend.in_flight += 1
        return backend

    def release(self, backend: Backend) -> None:
        backend.in_flight -= 1

    @contextmanager
    def lease(self) -> Iterator[Backend]:
        """`acquire` for the duration of a with-block."""
        backend = self.acquire()
        try:
            yield backend
        finally:
            self.release(backend)
