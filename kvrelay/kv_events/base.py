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


class FanOutPublisher(EventPublisher):
    """Every batch to several publishers in turn (e.g. the ZeroMQ socket and the in-process KV
    index of a data-parallel front end), each batch stamped with the rank first."""

    def __init__(self, publishers: list[EventPublisher], data_parallel_rank: int = 0) -> None:
        self.publishers = publishers
        self.data_parallel_rank = data_parallel_rank

    def publish(self, batch: KVEventBatch) -> None:
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        for publisher in self.publishers:
            publisher.publish(batch)

    def shutdown(self) -> None:
        for publisher in self.publishers:
            publisher.shutdown()
