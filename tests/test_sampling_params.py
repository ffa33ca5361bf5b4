import pickle
from typing import Any

import pytest

from kvrelay.sampling_params import SamplingParams, SamplingParamTypeError


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (1, 1.0, 1.0, 0, 0.0, None)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.stop == [] and p.stop_token_ids == []
    assert not p.include_stop_str_in_output and not p.ignore_eos
    assert (p.max_tokens, p.min_tokens, p.logprobs) == (16, 0, None)
    assert p.skip_special_tokens and p.spaces_between_special_tokens
    assert not p.is_greedy


def test_single_stop_string_becomes_a_list():
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]  # type: ignore[arg-type]


def test_stop_lists_are_copied_not_shared():
    stop = ["x"]
    p = SamplingParams(stop=stop)
    stop.append("y")
    assert p.stop == ["x"]


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-3, False), (1.0, False)])
def test_is_greedy_below_tiny_temperature(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_int_values_for_float_fields_are_accepted_as_floats():
    p = SamplingParams(temperature=0, top_p=1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)


def test_max_tokens_none_means_up_to_context():
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


def test_pickle_round_trip():
    p = SamplingParams(temperature=0.7, stop=["</s>"], seed=3, logprobs=2)
    assert pickle.loads(pickle.dumps(p)) == p


# (field, bad value, text the message must show so the user can find the mistake)
BAD_VALUES = [
    ("n", 0, "[1, 16384]"),
    ("n", 16385, "16385"),
    ("n", 1.0, "1.0"),
    ("temperature", 2.5, "[0, 2]"),
    ("seed", 2**63, str(2**63)),
    ("seed", -(2**63) - 1, "64-bit"),
    ("temperature", -0.1, "-0.1"),
    ("temperature", float("nan"), "nan"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "1.5"),
    ("top_k", -2, "-2"),
    ("min_p", -0.1, "[0, 1]"),
    ("min_p", 1.1, "1.1"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("presence_penalty", -2.1, "-2.1"),
    ("frequency_penalty", 3.0, "3.0"),
    ("frequency_penalty", -3.0, "[-2, 2]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", -1.0, "-1.0"),
    ("max_tokens", 0, ">= 1"),
    ("min_tokens", -1, "-1"),
    ("logprobs", -1, "[0, 20]"),
    ("logprobs", 21, "21"),
    ("stop", ["ok", ""], "non-empty"),
    ("stop_token_ids", [1, -5], "-5"),
    ("stop_token_ids", [1, 2.0], "2.0"),
    ("stop_token_ids", "12", "'12'"),
    ("seed", 1.5, "1.5"),
    ("seed", "42", "'42'"),
    ("temperature", "hot", "'hot'"),
    ("top_k", 2.5, "2.5"),
    ("top_k", True, "True"),
    ("max_tokens", "16", "'16'"),
    ("stop", 5, "5"),
    ("stop", [b"bytes"], "b'bytes'"),
    ("ignore_eos", "yes", "'yes'"),
]


@pytest.mark.parametrize("field, value, shown", BAD_VALUES)
def test_bad_value_raises_value_error_naming_field_and_value(field: str, value: Any, shown: str):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    assert field in str(info.value) and shown in str(info.value)


def test_min_tokens_above_max_tokens_names_both():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens=4.*got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_n_above_one_is_parallel_sampling_but_not_with_greedy():
    assert SamplingParams(n=3).n == 3
    with pytest.raises(ValueError, match="n must be 1 when sampling greedily"):
        SamplingParams(n=3, temperature=0.0)


def test_seed_minus_one_means_no_seed_as_in_vllm():
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)


def test_wrong_type_is_also_a_type_error():
    with pytest.raises(TypeError, match="temperature"):
        SamplingParams(temperature="hot")  # type: ignore[arg-type]
    assert issubclass(SamplingParamTypeError, ValueError)


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_disabled_or_positive_is_valid(top_k):
    assert SamplingParams(top_k=top_k).top_k == top_k
