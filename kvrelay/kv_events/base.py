"""The publisher interface the scheduler sees, and its null object. No ZeroMQ here: the
scheduler side (pure Python) imports this module, never the socket code."""

from __future__ import annotations

from abc import ABC, abstractmethod

from kvrelay.kv_events.events import KVEventBatch


class EventPublisher(ABC):
    @abstractmethod
    def publish(self, batch: KVEventBatch) -> None:
        """Hand one step's batch over, in step order. Must return at once: the engine step is
        waiting. A publisher that cannot keep up drops batches (and says so), never blocks."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop publishing and release sockets and threads. Idempotent."""


class NullEventPublisher(EventPublisher):
    """Events disabled: every call does nothing."""

    def publish(self, batch: KVEventBatch) -> None:
        return None

    def shutdown(self) -> None:
        return None
