"""Profiles: the JSON schema round trip, its errors, and a real measurement on a tiny model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvrelay.disagg.planner.profile import load_profile, profile_from_json
from kvrelay.disagg.planner.profiler import (
    QUICK_GRID,
    decode_batches,
    decode_table,
    fit_step,
    run_profile,
    spread_order,
)
from kvrelay.model import layers
from tests.disagg.planner.conftest import hand_profile


def test_schema_round_trip(tmp_path: Path) -> None:
    profile = hand_profile()
    profile.decode_by_batch = {1: 5.0, 3: 4.0}
    profile.step_time_scale = 1.5
    profile.co_run_slowdown = {"prefill": 1.2, "decode": 1.05}
    profile.samples = {"prefill": [{"batch_tokens": 8, "num_seqs": 1, "prefix_tokens": 0, "kpairs": 0.036,
                                    "ms": 3.0}], "decode": [], "transfer": []}
    path = tmp_path / "p.json"
    profile.save(path)
    again = load_profile(path)
    assert again == profile
    assert json.loads(path.read_text())["format"] == "kvrelay-profile"


@pytest.mark.parametrize("edit, message", [
    (lambda o: o.pop("format"), "not a kvrelay profile"),
    (lambda o: o.update(version=99), "version 99"),
    (lambda o: o.pop("decode"), "'decode'"),
    (lambda o: o["prefill"].update(per_token_ms="fast"), "prefill.per_token_ms"),
    (lambda o: o["engine"].pop("num_blocks"), "engine.num_blocks"),
    (lambda o: o.update(decode_by_batch={"0": 1.0}), "decode_by_batch has batch size '0'"),
    (lambda o: o.update(decode_by_batch={"2": -1}), "decode_by_batch.2 must be a number >= 0"),
    (lambda o: o.update(decode_by_batch=[1, 2]), "decode_by_batch must be an object"),
    (lambda o: o.update(step_time_scale=0), "step_time_scale must be a number > 0"),
    (lambda o: o.update(co_run_slowdown={"prefill": 0}), "co_run_slowdown.prefill must be a number > 0"),
    (lambda o: o.update(co_run_slowdown={"mixed": 1.1}), "co_run_slowdown has the key 'mixed'"),
    (lambda o: o.update(co_run_slowdown=1.2), "co_run_slowdown must be an object"),
])
def test_bad_profile_fields_are_named(edit, message: str) -> None:  # type: ignore[no-untyped-def]
    obj = hand_profile().to_json()
    edit(obj)
    with pytest.raises(ValueError, match=message):
        profile_from_json(obj)


def test_unknown_model_in_a_kvrelay_profile(tmp_path: Path) -> None:
    hand_profile().save(tmp_path / "p.json")
    with pytest.raises(ValueError, match="'other' is not in profile"):
        load_profile(tmp_path / "p.json", model="other")


def test_fit_recovers_coefficients_and_never_goes_negative() -> None:
    rows = [(t, 1, t * t / 2000) for t in (16, 64, 256, 1024)]
    times = [2.0 + 0.05 * t + 0.3 * k for t, _, k in rows]
    fit = fit_step(rows, times, (True, True, False, True))
    assert fit.intercept_ms == pytest.approx(2.0) and fit.per_token_ms == pytest.approx(0.05)
    assert fit.per_kpair_ms == pytest.approx(0.3) and fit.per_seq_ms == 0
    falling = fit_step([(1, 0, 0), (2, 0, 0), (4, 0, 0)], [3.0, 2.0, 1.0], (True, True, False, False))
    assert falling.per_token_ms >= 0 and falling.intercept_ms >= 0


def test_profile_a_tiny_model_with_the_quick_grid() -> None:
    from kvrelay import LLM
    from tests.tiny import tiny_loaded_model

    llm = LLM(loaded_model=tiny_loaded_model(), block_size=16, kv_cache_memory="4MiB",
              max_num_batched_tokens=128)
    profile = run_profile(llm.engine, QUICK_GRID, max_seconds=120, threads=1, backends=["tcp"],
                          progress=False)
    assert {s["prefix_tokens"] for s in profile.samples["prefill"]} == {0, 16}
    # the grid's sizes: the engine's linear layers change route only past 512 rows
    assert {s["batch_size"] for s in profile.samples["decode"]} == {1, 4}
    assert sorted(profile.decode_by_batch) == [1, 4]
    assert profile.transfer["tcp"].ms_per_mib >= 0 and len(profile.samples["transfer"]) == 2
    assert profile.num_blocks == llm.engine.num_blocks and profile.kv_bytes_per_token > 0
    assert profile.step_ms([(32, 0)], []) > 0 and profile.step_ms([], [16, 16]) > 0
    assert profile_from_json(json.loads(json.dumps(profile.to_json()))) == profile
    assert llm.engine.scheduler.blocks_in_use == 0


def test_decode_by_batch_is_interpolated_between_sampled_sizes() -> None:
    profile = hand_profile()  # decode fit: 5 ms flat, no per-sequence slope
    profile.decode = replace(profile.decode, per_seq_ms=0.5, per_kpair_ms=2.0)
    profile.decode_by_batch = {1: 10.0, 2: 11.0, 3: 6.0, 8: 8.5}
    assert profile.step_ms([], [0]) == pytest.approx(10.0 + 2.0 * 0.001)  # K = 1 * (0 + 1) / 1000
    assert profile.step_ms([], [0, 0, 0]) == pytest.approx(6.0 + 2.0 * 0.003)  # cheaper than 2
    assert profile.decode_base_ms(5) == pytest.approx(6.0 + 2.5 * 2 / 5)  # between 3 and 8
    assert profile.decode_base_ms(10) == pytest.approx(8.5 + 0.5 * 2)  # past 8: the fit's slope
    assert profile.step_ms([(4, 0)], [0]) == profile.prefill.predict_ms(5, 2, 0.011)  # prefill: the fit


def test_decode_grid_samples_both_sides_of_the_engine_route_change(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layers, "_ONEDNN", True)
    assert decode_batches([1, 4, 8]) == [1, 4, 8]  # 1..128 rows: one route (the native kernel)
    assert decode_batches([1]) == [1]
    assert decode_batches([2, 600]) == [2, 128, 129, 600]  # then oneDNN
    monkeypatch.setattr(layers, "_ONEDNN", False)
    assert decode_batches([2, 600]) == [2, 512, 513, 600]  # native, then F.linear


def test_decode_table_takes_the_median_less_the_context_term() -> None:
    rows = [{"batch_size": 2, "kpairs": k, "ms": 10.0 + 2.0 * k + extra}
            for k, extra in ((0.1, 0.0), (1.0, 1.0), (2.0, 9.0))]
    assert decode_table(rows, per_kpair_ms=2.0) == {2: pytest.approx(11.0)}


def test_cases_are_ordered_so_a_run_cut_short_still_spans_the_grid() -> None:
    assert spread_order(5) == [0, 4, 2, 1, 3]
    assert all(sorted(spread_order(n)) == list(range(n)) for n in range(20))
    assert spread_order(9)[:3] == [0, 8, 4]  # the ends and the middle first


def test_step_time_scale_multiplies_engine_time_not_the_served_step_overhead() -> None:
    profile = hand_profile()  # prefill 10 ms + 1 ms per token
    profile.overhead_ms = {"step": 3.0}
    profile.step_time_scale = 2.0
    assert profile.step_ms([(10, 0)], []) == pytest.approx(2.0 * 20.0 + 3.0)
