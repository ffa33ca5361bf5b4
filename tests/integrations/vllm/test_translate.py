"""The adapter's translation of vLLM's objects, with stand-ins of their shapes (vLLM itself is not
needed: translate.py is duck-typed, and kvrelay's own venv runs this file)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from types import SimpleNamespace
from typing import Any

import pytest

from kvrelay.integrations.vllm.offload_keys import VllmBlockHashKeyer
from kvrelay.integrations.vllm.translate import (
    VllmRequestView,
    kvrelay_connector_output,
    kvrelay_scheduler_output,
    kvrelay_transfer_config,
    request_status,
)
from kvrelay.request import RequestStatus


class VllmStatus(Enum):  # vLLM's names, some of which kvrelay lacks
    WAITING = 1
    WAITING_FOR_REMOTE_KVS = 2
    FINISHED_LENGTH_CAPPED = 3
    FINISHED_IGNORED = 4
    WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR = 5


@dataclass
class FakeRequest:
    request_id: str = "r1"
    prompt_token_ids: list[int] | None = field(default_factory=lambda: list(range(10)))
    num_computed_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None
    status: VllmStatus = VllmStatus.WAITING
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids or [])


def test_the_request_view_reads_vllms_request_and_writes_its_kv_transfer_params_through() -> None:
    request = FakeRequest(kv_transfer_params={"do_remote_prefill": True})
    view = VllmRequestView(request)
    assert (view.request_id, view.num_prompt_tokens, view.prompt_token_ids) == ("r1", 10, list(range(10)))
    view.kv_transfer_params = {"do_remote_prefill": False}
    assert request.kv_transfer_params == {"do_remote_prefill": False}


def test_a_request_without_prompt_token_ids_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="r1 has no prompt token ids"):
        _ = VllmRequestView(FakeRequest(prompt_token_ids=None)).prompt_token_ids


@pytest.mark.parametrize(("status", "expected"), [
    (VllmStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_LENGTH_CAPPED),
    (VllmStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.WAITING_FOR_REMOTE_KVS),
    (VllmStatus.FINISHED_IGNORED, RequestStatus.FINISHED_ABORTED),
    (VllmStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR, RequestStatus.WAITING)])
def test_vllm_statuses_map_to_kvrelays_by_name(status: VllmStatus, expected: RequestStatus) -> None:
    assert request_status(status) == expected


def _scheduler_output() -> SimpleNamespace:
    new = SimpleNamespace(req_id="new", prompt_token_ids=[1, 2, 3], block_ids=([7, 8],),
                          num_computed_tokens=0)
    cached = SimpleNamespace(req_ids=["running", "resumed"], resumed_req_ids={"resumed"},
                             new_block_ids=[([9],), ([3, 4],)], num_computed_tokens=[40, 0],
                             all_token_ids={"resumed": [5, 6, 7]})
    return SimpleNamespace(scheduled_new_reqs=[new], scheduled_cached_reqs=cached,
                           num_scheduled_tokens={"new": 3, "running": 1, "resumed": 3},
                           total_num_scheduled_tokens=7, finished_req_ids={"gone"})


def test_the_scheduler_output_is_translated_and_a_resumed_request_starts_its_block_list_over() -> None:
    vllm_output = _scheduler_output()
    out = kvrelay_scheduler_output(vllm_output)
    assert [(r.req_id, r.block_ids, r.prompt_token_ids) for r in out.scheduled_new_reqs] == [
        ("new", [7, 8], [1, 2, 3]), ("resumed", [3, 4], [5, 6, 7])]
    assert [(r.req_id, r.new_block_ids, r.num_computed_tokens) for r in out.scheduled_cached_reqs] == [
        ("running", [9], 40)]
    assert out.num_scheduled_tokens == {"new": 3, "running": 1, "resumed": 3}
    assert out.finished_req_ids == {"gone"} and out.total_num_scheduled_tokens == 7
    assert vllm_output == _scheduler_output()  # vLLM's object is only read


def test_a_failed_receive_leaves_finished_recving_on_kvrelays_side() -> None:
    vllm_output = SimpleNamespace(finished_sending={"p1"}, finished_recving={"ok", "bad"},
                                  failed_recving={"bad"}, invalid_block_ids={3})
    out = kvrelay_connector_output(vllm_output)
    assert (out.finished_sending, out.finished_recving, out.failed_recving, out.invalid_block_ids) == (
        {"p1"}, {"ok"}, {"bad"}, {3})


def test_vllms_transfer_config_becomes_kvrelays_with_the_side_channel_address_from_extra_config() -> None:
    vllm_config = SimpleNamespace(kv_connector_extra_config={"backend": "tcp", "kv_ip": "10.0.0.5"},
                                  kv_role="kv_producer", kv_load_failure_policy="fail", engine_id="e1",
                                  kv_port=15000, kv_buffer_device="cpu")
    config = kvrelay_transfer_config(vllm_config, "NixlConnector", kv_on_host=True)
    assert (config.kv_connector, config.kv_role, config.kv_load_failure_policy, config.engine_id) == (
        "NixlConnector", "kv_producer", "fail", "e1")
    assert (config.kv_ip, config.kv_port) == ("10.0.0.5", 15000)
    assert config.kv_connector_extra_config == {"backend": "tcp"}
    assert config.kv_buffer_device == "cuda"  # KV in host memory: no host mirror to stage through


def _keyer_request(num_tokens: int, salt: str | None = None, mm: bool = False) -> VllmRequestView:
    hashes = [bytes([i]) * 32 for i in range(num_tokens // 16)]  # one per full 16-token block
    return VllmRequestView(FakeRequest(prompt_token_ids=list(range(num_tokens)), block_hashes=hashes,
                                       cache_salt=salt, mm_features=[object()] if mm else []))


def test_offload_keys_come_from_vllms_block_hashes_a_chunk_per_last_block_and_a_tail() -> None:
    keyer = VllmBlockHashKeyer(chunk_tokens=64, fingerprint="fp", hash_block_size=16)
    keys = keyer.request_keys(_keyer_request(150))  # type: ignore[arg-type]
    assert len(keys.chunks) == 2 and keys.tail is not None and keys.tail_tokens == 22
    assert keys.chunks[0] == keyer._key(bytes([3]) * 32)  # chunk 0 ends with block 3
    assert keyer.request_keys(_keyer_request(150)) == keys  # the same hashes, the same keys
    other = VllmBlockHashKeyer(chunk_tokens=64, fingerprint="another model", hash_block_size=16)
    assert not set(other.request_keys(_keyer_request(150)).all) & set(keys.all)  # type: ignore[arg-type]
    salted = keyer.request_keys(_keyer_request(150, salt="tenant"))  # type: ignore[arg-type]
    assert salted.tail != keys.tail
    assert keyer.request_keys(_keyer_request(150, mm=True)).tail is None  # type: ignore[arg-type]
    assert keyer.token_keys(list(range(150))) is None


def test_a_chunk_size_vllm_cannot_hash_to_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of vLLM's hash block size 128"):
        VllmBlockHashKeyer(chunk_tokens=96, fingerprint="fp", hash_block_size=128)
