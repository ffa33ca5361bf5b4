"""vLLM's own NixlConnector P/D pair, for the prompts where a kvrelay pair's answer differs from one
vLLM instance's: if vLLM's pair answers as ours does, the difference is vLLM's numerics (a decode
instance computing one token on loaded KV), not the transfer. Started only when needed."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tests.entrypoints.serve_process import free_port
from tests.integrations.vllm.helpers import answer, complete, table
from tests.integrations.vllm.toy_proxy import PREFILL_PARAMS
from tests.vllm_serve import VllmServer


def nixl_pair(log_dir: Path) -> tuple[VllmServer, VllmServer]:
    """vLLM's NixlConnector P and D (host buffers: kv_buffer_device cpu), one core each."""
    servers = []
    for role, core in (("kv_producer", 0), ("kv_consumer", 1)):
        config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_buffer_device": "cpu",
                  "kv_load_failure_policy": "recompute"}
        servers.append(VllmServer(log_dir / f"vllm-nixl-{role}.log", "--kv-transfer-config",
                                  json.dumps(config), core=core,
                                  env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())}))
    return servers[0], servers[1]


def nixl_answer(p: VllmServer, d: VllmServer, prompt: Sequence[int]) -> str:
    prefill = complete(p.url, prompt, max_tokens=1, kv_transfer_params=dict(PREFILL_PARAMS))
    assert prefill.status_code == 200, prefill.text
    return answer(d.url, prompt, kv_transfer_params=prefill.json()["kv_transfer_params"])


def explain_mismatches(log_dir: Path, prompts: Sequence[list[int]], ours: Sequence[str]) -> None:
    """Assert that vLLM's NixlConnector pair answers each prompt as the kvrelay pair did."""
    p, d = nixl_pair(log_dir)
    with p, d:
        p.wait_healthy()
        d.wait_healthy()
        theirs = [nixl_answer(p, d, prompt) for prompt in prompts]
    rows = [(len(prompt), a == b, repr(a[:40]), repr(b[:40]))
            for prompt, a, b in zip(prompts, ours, theirs, strict=True)]
    print("\nprompts whose P/D answer differs from one instance, against vLLM's NixlConnector pair\n"
          + table(("tokens", "same as NixlConnector", "KvrelayConnector", "NixlConnector"), rows))
    assert list(ours) == theirs, "the kvrelay pair differs from vLLM's own NixlConnector pair"
