"""The cluster simulator against cases worked out by hand (see conftest.hand_profile)."""

from __future__ import annotations

import pytest

from kvrelay.disagg.planner.profile import TransferFit
from kvrelay.disagg.planner.sim import SLO, ClusterSim, ClusterSpec, SimOptions, attainment, percentile
from kvrelay.disagg.planner.workload import RequestSpec, Workload
from tests.disagg.planner.conftest import hand_profile

ONE = ClusterSpec(num_colocated=1)
PD = ClusterSpec(num_prefill=1, num_decode=1)


def run(cluster: ClusterSpec, requests: list[RequestSpec], profile=None, chunk: int = 512,
        options: SimOptions | None = None):  # type: ignore[no-untyped-def]
    sim = ClusterSim(cluster, profile or hand_profile(), Workload(tuple(requests), hash_block_tokens=chunk),
                     options)
    result = sim.run()
    for inst in sim._all_instances():  # leak check: every block back once everything finished
        assert inst.pool.blocks_in_use == 0, inst.name
    return result


def test_one_request_prefill_then_decodes() -> None:
    result = run(ONE, [RequestSpec(0.0, 100, 4)])
    assert result.ttft_s[0] == pytest.approx(0.110)  # 10 + 100 ms
    assert result.tpot_s[0] == pytest.approx(0.005)  # three 5 ms decode steps after the first token


def test_two_overlapping_requests_share_a_mixed_step() -> None:
    result = run(ONE, [RequestSpec(0.0, 100, 3), RequestSpec(0.05, 50, 2)])
    # step 1 [0, 110 ms): A's prompt. step 2: A decodes + B's 50 prompt tokens = 51 tokens, 61 ms,
    # ends at 171 ms. step 3: both decode, 5 ms, ends at 176 ms.
    assert result.ttft_s == pytest.approx([0.110, 0.171 - 0.05])
    assert result.tpot_s == pytest.approx([(0.176 - 0.110) / 2, 0.005])


def test_a_queue_builds_up_when_the_budget_holds_one_prompt() -> None:
    result = run(ONE, [RequestSpec(0.0, 100, 1)] * 3, hand_profile(budget=100))
    assert result.ttft_s == pytest.approx([0.110, 0.220, 0.330])


def test_long_prompt_is_chunked_over_steps() -> None:
    result = run(ONE, [RequestSpec(0.0, 150, 1)], hand_profile(budget=100))
    assert result.ttft_s[0] == pytest.approx(0.110 + 0.060)  # 100 tokens, then 50


def test_transfer_is_on_the_critical_path_of_pd() -> None:
    result = run(PD, [RequestSpec(0.0, 100, 2)])
    # P: 110 ms; D reads 100 MiB: 2 + 50 ms -> 162 ms; D computes the last prompt token: 5 ms
    assert result.ttft_s[0] == pytest.approx(0.167)
    assert result.tpot_s[0] == pytest.approx(0.005)
    assert result.transfer_bytes == 100 * 2**20


def test_transfers_from_one_prefill_instance_queue_on_its_link() -> None:
    slow = hand_profile()
    slow.transfer = {"tcp": TransferFit(2.0, 5.0)}  # 100 tokens: 502 ms
    two = ClusterSpec(num_prefill=1, num_decode=2)
    result = run(two, [RequestSpec(0.0, 100, 2)] * 2, slow)
    # P prefills A then B (110 ms each); B's read waits for A's on P's link: 612 -> 1114 ms
    assert result.ttft_s == pytest.approx([0.617, 1.119])
    apart = run(two, [RequestSpec(0.0, 100, 2)] * 2, slow, options=SimOptions(link_scope="per-pair"))
    assert apart.ttft_s == pytest.approx([0.617, 0.727])


def test_prefix_hit_skips_the_cached_chunks() -> None:
    first = RequestSpec(0.0, 100, 1, hash_ids=(1, 2, 3))
    second = RequestSpec(1.0, 100, 1, hash_ids=(1, 2, 9))
    result = run(ONE, [first, second], chunk=32)
    assert result.ttft_s[1] == pytest.approx(0.010 + 0.036)  # 64 tokens hit, 36 computed
    assert result.prefix_hit_tokens == 64
    cold = run(ONE, [first, second], chunk=32, options=SimOptions(prefix_cache=False))
    assert cold.ttft_s[1] == pytest.approx(0.110)


def test_decode_instance_reads_only_what_its_own_cache_lacks() -> None:
    first = RequestSpec(0.0, 100, 1, hash_ids=(1, 2, 3))
    second = RequestSpec(1.0, 100, 1, hash_ids=(1, 2, 9))
    result = run(PD, [first, second], chunk=32)
    assert result.transfer_bytes == (100 + 36) * 2**20


def test_preemption_when_blocks_run_out_and_everything_still_finishes() -> None:
    # 10 blocks of 16 tokens; two requests that each grow to 128 tokens cannot both stay
    sim = ClusterSim(ONE, hand_profile(num_blocks=10), Workload((RequestSpec(0.0, 64, 64),) * 2))
    result = sim.run()
    assert result.num_preemptions >= 1
    assert all(t < float("inf") for t in result.ttft_s + result.tpot_s)
    assert sim.front.instances[0].pool.blocks_in_use == 0


def test_request_larger_than_the_pool_is_rejected_not_simulated() -> None:
    result = run(ONE, [RequestSpec(0.0, 1000, 1)], hand_profile(num_blocks=10))
    assert result.num_rejected == 1 and result.ttft_s == [float("inf")]


def test_attainment_uses_the_percentile_of_each_metric() -> None:
    result = run(ONE, [RequestSpec(0.0, 100, 1)] * 3, hand_profile(budget=100))
    assert percentile([0.11, 0.22, 0.33], 50) == pytest.approx(0.22)
    ok = attainment(result, SLO(ttft_s=0.30, tpot_s=1.0, percentile=50), rate=1.0)
    assert ok.passed and ok.share_in_slo == pytest.approx(2 / 3)
    # p90 = 0.22 + 0.8 * 0.11 = 0.308
    assert not attainment(result, SLO(ttft_s=0.30, tpot_s=1.0, percentile=90), rate=1.0).passed


def test_cluster_shape_is_validated() -> None:
    with pytest.raises(ValueError, match="xPyD"):
        ClusterSpec(num_prefill=1)
    with pytest.raises(ValueError, match="xPyD"):
        ClusterSpec(num_colocated=1, num_prefill=1, num_decode=1)


def test_shared_host_slows_steps_only_while_another_instance_computes() -> None:
    crowded = hand_profile()
    crowded.co_run_slowdown = {"prefill": 2.0}
    two = ClusterSpec(num_colocated=2)
    requests = [RequestSpec(0.0, 90, 1), RequestSpec(0.05, 90, 1)]  # one per instance, 100 ms each alone
    assert run(two, requests, crowded).ttft_s == pytest.approx([0.100, 0.100])  # apart: as profiled
    shared = run(two, requests, crowded, options=SimOptions(shared_host=True))
    # A alone for 50 ms (half its work), then both at half speed: A's other 50 ms take 100 (ends
    # at 150 ms), while B does 50 of its 100; then B alone for its last 50 (ends at 200 ms).
    assert shared.ttft_s == pytest.approx([0.150, 0.150])


def test_shared_host_prefill_beside_a_decoding_instance() -> None:
    crowded = hand_profile()
    crowded.co_run_slowdown = {"prefill": 1.5, "decode": 1.2}
    result = run(PD, [RequestSpec(0.0, 100, 3), RequestSpec(0.160, 40, 1)], crowded,
                 options=SimOptions(shared_host=True))
    # A: P alone 110 ms; read 52 ms -> 162 ms. B reaches P at 160 ms: 50 ms of work, 2 alone.
    # From 162 D steps A (last prompt token, then two decodes: 5 ms each, 6 beside P's prefill):
    # tokens at 168, 174, 180 ms, while P does 4 ms of work per 6 ms (36 left at 180 ms, then
    # alone: B's prompt done at 216 ms); read 2 + 20 ms -> 238; D's step -> 243 ms.
    assert result.ttft_s == pytest.approx([0.168, 0.243 - 0.160])
    assert result.tpot_s[0] == pytest.approx(0.006)
    assert run(PD, [RequestSpec(0.0, 100, 3)], crowded, options=SimOptions(shared_host=True)).ttft_s == \
        pytest.approx([0.167])  # alone the whole way: as profiled
