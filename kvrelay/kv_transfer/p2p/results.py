"""What D's side of a P2P connector reports after each step: the loads that settled."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadResults:
    """Requests whose KV arrived (`finished`) or will not (`failed`), blocks that arrived
    corrupted (`invalid_block_ids`), and counters for the connector's stats."""

    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    stats: dict[str, float] = field(default_factory=dict)

    def count(self, key: str, value: float = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + value
