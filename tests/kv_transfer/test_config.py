import dataclasses
import json

import pytest

from kvrelay.kv_transfer import KVTransferConfig


def test_defaults_give_a_both_role_recompute_policy_and_a_fresh_engine_id():
    a, b = KVTransferConfig(), KVTransferConfig()
    assert (a.kv_connector, a.kv_role, a.kv_load_failure_policy) == (None, "kv_both", "recompute")
    assert (a.kv_ip, a.kv_port, a.kv_connector_extra_config) == ("127.0.0.1", 14579, {})
    assert a.engine_id and a.engine_id != b.engine_id


def test_from_any_accepts_a_dict_a_json_string_a_config_and_none():
    d = {"kv_connector": "ExampleConnector", "kv_role": "kv_producer", "engine_id": "p0",
         "kv_connector_extra_config": {"shared_storage_path": "/tmp/x"}}
    from_dict = KVTransferConfig.from_any(d)
    assert from_dict == KVTransferConfig.from_any(json.dumps(d))
    assert from_dict is not None and from_dict.kv_connector_extra_config == {"shared_storage_path": "/tmp/x"}
    assert KVTransferConfig.from_any(from_dict) is from_dict
    assert KVTransferConfig.from_any(None) is None


def test_absent_or_null_engine_id_is_generated():
    cfg = KVTransferConfig.from_any({"kv_connector": "X", "engine_id": None})
    assert cfg is not None and len(cfg.engine_id) == 32


def test_unknown_key_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match="'kv_conector'"):
        KVTransferConfig.from_any({"kv_conector": "ExampleConnector"})


@pytest.mark.parametrize("key,value", [
    ("kv_port", "14579"), ("kv_port", True), ("kv_connector_extra_config", ["a"]),
    ("kv_connector", 3), ("kv_role", None), ("engine_id", 5), ("kv_buffer_size", "1GiB"),
])
def test_wrong_type_is_an_error_naming_the_key(key, value):
    with pytest.raises(ValueError, match=repr(key)):
        KVTransferConfig.from_any({key: value})


def test_bad_json_names_the_problem():
    with pytest.raises(ValueError, match="not valid JSON"):
        KVTransferConfig.from_any('{"kv_connector": ')
    with pytest.raises(ValueError, match="got list"):
        KVTransferConfig.from_any('["ExampleConnector"]')


@pytest.mark.parametrize("field,value,match", [
    ("kv_role", "kv_prefill", "kv_role must be one of"),
    ("kv_load_failure_policy", "retry", "kv_load_failure_policy must be one of"),
    ("kv_port", 0, "kv_port must be in"),
    ("kv_buffer_size", 0, "kv_buffer_size must be a positive number of bytes"),
])
def test_out_of_range_values_are_rejected(field, value, match):
    with pytest.raises(ValueError, match=match):
        KVTransferConfig(**{field: value})


def test_module_path_needs_a_class_name():
    with pytest.raises(ValueError, match="name the class"):
        KVTransferConfig(kv_connector_module_path="my.module")


@pytest.mark.parametrize("role,producer,consumer", [
    ("kv_producer", True, False), ("kv_consumer", False, True), ("kv_both", True, True),
])
def test_producer_and_consumer_follow_the_role(role, producer, consumer):
    cfg = KVTransferConfig(kv_role=role)
    assert (cfg.is_producer, cfg.is_consumer) == (producer, consumer)


def test_config_is_frozen_and_keeps_its_own_copy_of_extra_config():
    extra = {"shared_storage_path": "/a"}
    cfg = KVTransferConfig(kv_connector="ExampleConnector", kv_connector_extra_config=extra)
    extra["shared_storage_path"] = "/b"
    assert cfg.kv_connector_extra_config == {"shared_storage_path": "/a"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kv_port = 1  # type: ignore[misc]
    assert KVTransferConfig.from_any(cfg.to_dict()) == cfg


def test_kv_buffer_size_takes_bytes_as_an_int_or_a_float_as_vllm_does():
    assert KVTransferConfig.from_any({"kv_buffer_size": 1e9}).kv_buffer_size == 1e9
    assert KVTransferConfig.from_any({"kv_buffer_size": 4096}).kv_buffer_size == 4096
    assert KVTransferConfig().kv_buffer_size is None
