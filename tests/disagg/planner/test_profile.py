"""Profiles: the JSON schema round trip, its errors, and a real measurement on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvrelay.disagg.planner.profile import load_profile, profile_from_json
from kvrelay.disagg.planner.profiler import QUICK_GRID, fit_step, run_profile
from tests.disagg.planner.conftest import hand_profile


def test_schema_round_trip(tmp_path: Path) -> None:
    profile = hand_profile()
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
    assert {s["batch_size"] for s in profile.samples["decode"]} == {1, 4}  # one sample per case
    assert profile.transfer["tcp"].ms_per_mib >= 0 and len(profile.samples["transfer"]) == 2
    assert profile.num_blocks == llm.engine.num_blocks and profile.kv_bytes_per_token > 0
    assert profile.step_ms([(32, 0)], []) > 0 and profile.step_ms([], [16, 16]) > 0
    assert profile_from_json(json.loads(json.dumps(profile.to_json()))) == profile
    assert llm.engine.scheduler.blocks_in_use == 0
