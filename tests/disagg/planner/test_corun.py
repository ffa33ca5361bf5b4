"""The co-run measurement: which neighbour each kind is timed beside, the ratio, the fallback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kvrelay.disagg.planner import corun


class FakeTimer:
    """Steps that take `alone` ms, or `alone * factor[kind of the busy neighbour]` beside one."""

    def __init__(self, factor: dict[str, float]) -> None:
        self.factor = factor
        self.neighbour: str | None = None

    def _scale(self) -> float:
        return self.factor[self.neighbour] if self.neighbour else 1.0

    def prefill_ms(self, lens: list[int], prefix: int) -> float:
        return (10.0 + sum(lens)) * self._scale()

    def decode_ms(self, batch: int, context: int, steps: int,
                  before_step: Callable[[int], None] | None = None) -> list[tuple[int, float]]:
        out = []
        for i in range(steps):
            if before_step is not None:
                before_step(i)
            out.append((batch * context, (5.0 + batch) * self._scale()))
        return out


class FakeNeighbour:
    """Busy from the start, as corun.Neighbour is once it said ready; pause/resume as SIGSTOP/SIGCONT."""

    def __init__(self, timer: FakeTimer, kind: str, started: list[str]) -> None:
        self.timer, self.kind = timer, kind
        started.append(kind)
        timer.neighbour = kind

    def pause(self) -> None:
        self.timer.neighbour = None

    def resume(self) -> None:
        self.timer.neighbour = self.kind

    def __enter__(self) -> FakeNeighbour:
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.neighbour = None


def test_prefill_is_timed_beside_a_decoder_and_decode_beside_a_prefiller() -> None:
    timer = FakeTimer({"decode": 1.3, "prefill": 1.1})
    started: list[str] = []
    cases = corun.pick_cases([16, 64, 256, 4096], [1, 2, 8, 32], [64, 256, 1024], budget=2048, reps=1)
    assert cases.prefill_tokens == (16, 64, 256) and cases.decode_batches == (1, 8, 32)
    assert cases.decode_context == 256 and cases.reps == 3  # at least three steps per median
    slowdown, samples = corun.measure_co_run(timer, cases, lambda k: FakeNeighbour(timer, k, started))
    assert started == ["decode", "prefill"]
    assert slowdown == {"prefill": pytest.approx(1.3), "decode": pytest.approx(1.1)}
    assert [(s["kind"], s["size"], s["neighbour"]) for s in samples] == \
        [("prefill", 16, "decode"), ("prefill", 64, "decode"), ("prefill", 256, "decode"),
         ("decode", 1, "prefill"), ("decode", 8, "prefill"), ("decode", 32, "prefill")]
    assert samples[0]["alone_ms"] == 26.0 and samples[0]["co_run_ms"] == pytest.approx(26.0 * 1.3)


def test_a_neighbour_that_speeds_steps_up_is_noise_and_counts_as_no_slowdown() -> None:
    timer = FakeTimer({"decode": 0.9, "prefill": 1.0})
    cases = corun.pick_cases([32], [4], [64], budget=2048, reps=2)
    slowdown, samples = corun.measure_co_run(timer, cases, lambda k: FakeNeighbour(timer, k, []))
    assert slowdown == {"prefill": 1.0, "decode": 1.0}
    assert samples[0]["co_run_ms"] < samples[0]["alone_ms"]  # the raw measurement is kept as it was


def test_a_neighbour_that_cannot_start_says_why(tmp_path: Any) -> None:
    config = {"model": str(tmp_path / "no-such-model"), "dtype": "float32", "threads": 1, "block_size": 16,
              "kv_cache_memory": 4 * 2**20, "cache_dtype": "auto", "num_blocks_override": None,
              "max_num_batched_tokens": 64, "max_num_seqs": 4}
    with pytest.raises(RuntimeError, match="co-run neighbour \\(decode\\) did not start: .*no-such-model"):
        corun.Neighbour(config, "decode", startup_timeout_s=120)


def test_a_neighbour_steps_until_stopped(tmp_path: Any) -> None:
    from tests.tiny import write_tiny_model_dir

    model = write_tiny_model_dir(tmp_path / "model")
    config = {"model": str(model), "dtype": "float32", "threads": 1, "block_size": 16,
              "kv_cache_memory": 4 * 2**20, "cache_dtype": "auto", "num_blocks_override": None,
              "max_num_batched_tokens": 128, "max_num_seqs": 8}
    neighbour = corun.Neighbour(config, "prefill", startup_timeout_s=120)
    assert neighbour.proc.poll() is None  # ready and still stepping
    neighbour.pause()
    neighbour.resume()
    neighbour.pause()
    neighbour.stop()  # a paused neighbour stops too
    assert neighbour.proc.returncode is not None
    orphan = corun.Neighbour(config, "decode", startup_timeout_s=120)
    assert orphan.proc.stdin is not None
    orphan.proc.stdin.close()  # what the profiler's death does to the pipe
    assert orphan.proc.wait(timeout=60) == 0  # it leaves by itself, it does not step forever
    orphan.stop()
