"""DistServe mode: its formulas, batching rules and SLO test against hand-computed numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvrelay.disagg.planner.distserve import (
    DistServeConfig,
    DistServeSLO,
    distserve_goodput,
    simulate_distserve,
)
from kvrelay.disagg.planner.profile import (
    DistServeCoeffs,
    distserve_decode_ms,
    distserve_prefill_ms,
    load_profile,
)

DATA = Path(__file__).resolve().parents[3] / "data" / "distserve"  # shipped in the repo (data/README.md)
FLAT = DistServeCoeffs(prefill=(10.0, 0.0, 0.0), decoding_smallbs=(5.0, 0.0, 0.0),
                       decoding_largebs=(5.0, 0.0, 0.0))


def test_formulas_match_the_readme() -> None:
    c = DistServeCoeffs(prefill=(1.0, 0.1, 0.001), decoding_smallbs=(2.0, 0.01, 0.5),
                        decoding_largebs=(3.0, 0.02, 0.25), threshold=2)
    # (a + b*S + c*Q) + 1 (the PP term), + 2 + 1e-4*S: S = 30, Q = 500
    assert distserve_prefill_ms(c, [10, 20]) == pytest.approx(1 + 3 + 0.5 + 1 + 2 + 30e-4)
    # B = 1 < threshold: small-batch coefficients; C = 101
    assert distserve_decode_ms(c, [100]) == pytest.approx(2 + 1.01 + 0.5 + 2 + 100e-4)
    # B = 2 >= threshold: large-batch coefficients; C = 202
    assert distserve_decode_ms(c, [100, 100]) == pytest.approx(3 + 4.04 + 0.5 + 2 + 200e-4)


def test_one_request_ttft_and_tpot() -> None:
    run = simulate_distserve([0.0], [(100, 2)], FLAT, FLAT, max_prefill_tokens=1000)
    assert run.ttft_ms == pytest.approx([13.01])  # 10 + 1 + 2 + 0.01
    assert run.tpot_ms == pytest.approx([(7.01 + 7.0101) / 2])  # contexts 100, then 101


def test_prefill_batches_whole_requests_up_to_max_tokens() -> None:
    together = simulate_distserve([0.0, 0.0], [(100, 1), (100, 1)], FLAT, FLAT, max_prefill_tokens=200)
    assert together.ttft_ms == pytest.approx([13.02, 13.02])
    apart = simulate_distserve([0.0, 0.0], [(100, 1), (100, 1)], FLAT, FLAT, max_prefill_tokens=150)
    assert apart.ttft_ms == pytest.approx([13.01, 26.02])


def test_decode_batch_is_capped_by_total_context() -> None:
    # both requests reach decode together; 30,000 + 30,000 > 50,000 so they decode one at a time
    run = simulate_distserve([0.0], [(30_000, 1)] * 1, FLAT, FLAT, max_prefill_tokens=10**7)
    alone = run.tpot_ms[0]
    two = simulate_distserve([0.0, 0.0], [(30_000, 1), (30_000, 1)], FLAT, FLAT, max_prefill_tokens=10**7)
    assert two.tpot_ms[0] == pytest.approx(alone)
    assert two.tpot_ms[1] == pytest.approx(2 * alone)  # waits for the first one's step


def test_slo_test_is_on_the_90th_percentile_strictly() -> None:
    # ten requests at once, one prefill at a time (max 100 tokens): TTFTs 13.01 * k, k = 1..10
    run = simulate_distserve([0.0] * 10, [(100, 1)] * 10, FLAT, FLAT, max_prefill_tokens=100)
    assert run.ttft_ms == pytest.approx([13.01 * k for k in range(1, 11)])
    p90 = 13.01 * 9.1  # between the 9th and 10th order statistics
    assert DistServeSLO(ttft_ms=p90 + 1e-6, tpot_ms=100).passes(run)
    assert not DistServeSLO(ttft_ms=p90, tpot_ms=100).passes(run)
    # TPOT: one 7.0100 ms decode step per request (context 100), not below 7.01
    assert not DistServeSLO(ttft_ms=1e9, tpot_ms=7.01).passes(run)


@pytest.mark.parametrize("ttft_ms, tried, goodput", [
    (1e9, [4.0, 6.0, 7.0, 7.5, 7.75], 7.75),    # every rate passes: the upper end minus 0.25
    (1.0, [4.0, 2.0, 1.0, 0.5, 0.25], 0.0),     # none passes (a prefill alone is 13.01 ms)
])
def test_bisection_on_the_per_gpu_rate_stops_at_width_a_quarter(ttft_ms: float, tried: list[float],
                                                                goodput: float) -> None:
    config = distserve_goodput([(100, 1)] * 20, FLAT, FLAT, DistServeConfig(1, 1), 10**7,
                               DistServeSLO(ttft_ms=ttft_ms, tpot_ms=100), max_rate=8.0)
    assert [r for r, _ in config.tried] == tried
    assert config.per_gpu_rate == goodput and config.num_gpus == 2


def test_reads_distserve_profile_and_names_unknown_models() -> None:
    profile = load_profile(DATA / "profiler-a100-80g.distserve.json", model="facebook/opt-66b", tp=4)
    assert profile.distserve is not None and profile.gpus_per_instance == 4
    assert profile.num_blocks == 78496 // 16  # max_num_tokens.csv, tp 4, pp 1
    with pytest.raises(ValueError, match="facebook/opt-7b.*facebook/opt-13b"):
        load_profile(DATA / "profiler-a100-80g.distserve.json", model="facebook/opt-7b")
    with pytest.raises(ValueError, match="tensor parallel size 5"):
        load_profile(DATA / "profiler-a100-80g.distserve.json", model="facebook/opt-66b", tp=5)
