"""Merge the connector outputs of several workers (tensor parallel) into the scheduler's view.

Each worker moves its own shard of every request's KV, so a transfer is over only when every
worker says so:

* finished_sending: an id is passed on in the step its last worker reports it;
* receives: a worker settles an async load by reporting its id in finished_recving or in
  failed_recving. The id is passed on once every worker settled it: as failed_recving if any
  worker failed, else as finished_recving. NOTE: a failure is not passed on early, because the
  scheduler frees or reuses blocks of a failed load, and another worker may still be writing;
* invalid_block_ids are passed on at once (they settle nothing; the scheduler only remembers
  not to trust those blocks), and stats are summed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvrelay.kv_transfer.base import add_stats
from kvrelay.outputs import KVConnectorOutput


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        # NOTE: counts persist across steps: workers report the same id on different steps.
        self._sending_reports: Counter[str] = Counter()
        self._recving_reports: Counter[str] = Counter()
        self._failed_somewhere: set[str] = set()

    def aggregate(self, outputs: Sequence[KVConnectorOutput | None]) -> KVConnectorOutput:
        """One step's outputs, one per worker (None: that worker had nothing) -> one output."""
        if len(outputs) != self.world_size:
            raise ValueError(f"expected {self.world_size} worker outputs, got {len(outputs)}")
        merged = KVConnectorOutput()
        for output in outputs:
            if output is None:
                continue
            self._sending_reports.update(output.finished_sending)
            self._recving_reports.update(output.finished_recving | output.failed_recving)
            self._failed_somewhere |= output.failed_recving
            merged.invalid_block_ids |= output.invalid_block_ids
            add_stats(merged.stats, output.stats)
        merged.finished_sending = self._take_complete(self._sending_reports)
        for req_id in self._take_complete(self._recving_reports):
            if req_id in self._failed_somewhere:
                self._failed_somewhere.discard(req_id)
                merged.failed_recving.add(req_id)
            else:
                merged.finished_recving.add(req_id)
        return merged

    def _take_complete(self, reports: Counter[str]) -> set[str]:
        done = {req_id for req_id, count in reports.items() if count >= self.world_size}
        for req_id in done:
            del reports[req_id]
        return done

    def num_pending(self) -> int:
        """Ids some but not all workers have reported (for tests and leak checks)."""
        return len(self._sending_reports) + len(self._recving_reports)
