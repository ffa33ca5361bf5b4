"""Builders for NixlConnector tests: P and D engines of the tiny model, and a driver that steps
both in one thread (their side-channel and peer threads run beside it)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvrelay.engine.llm import LLM
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams
from tests.tiny import tiny_loaded_model

BLOCK_SIZE = 4
NUM_BLOCKS = 64
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nixl_config(role: str, port: int | None = None, policy: str = "recompute",
                **extra: Any) -> dict[str, Any]:
    # NOTE: the start-up loopback check is tested on its own (test_path_check.py); here it would
    # only add a transport pair to every engine start.
    extra.setdefault("loopback_check_bytes", 0)
    return {"kv_connector": "NixlConnector", "kv_role": role, "kv_ip": "127.0.0.1",
            "kv_port": port or free_port(), "kv_load_failure_policy": policy,
            "kv_connector_extra_config": extra}


def make_engine(kv_transfer_config: dict[str, Any] | None = None, num_blocks: int = NUM_BLOCKS,
                max_num_batched_tokens: int = 256, batch_invariant: bool = False,
                **model_overrides: Any) -> LLMEngine:
    return LLM(loaded_model=tiny_loaded_model(**model_overrides), block_size=BLOCK_SIZE,
               num_blocks=num_blocks, max_num_batched_tokens=max_num_batched_tokens,
               kv_transfer_config=kv_transfer_config, batch_invariant=batch_invariant).engine


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompt(n: int, salt: int = 0) -> list[int]:
    return [1 + (i * 37 + salt * 101) % 250 for i in range(n)]


def kv_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(("kv-", "kvrelay-"))]


def shutdown(engine: LLMEngine) -> None:
    """What the engine's shutdown hook must do: stop both connector halves."""
    for connector in (engine.scheduler.connector, engine.runner.connector):
        if connector is not None and hasattr(connector, "shutdown"):
            connector.shutdown()


class PD:
    """A prefill and a decode engine in this process, stepped together."""

    def __init__(self, p: LLMEngine, d: LLMEngine) -> None:
        self.p, self.d = p, d

    def step(self) -> list[RequestOutput]:
        self.p.step()
        return self.d.step()

    def prefill(self, token_ids: list[int], request_id: str) -> dict[str, Any] | None:
        """Run the prefill leg on P; returns P's kv_transfer_params."""
        self.p.add_request({"prompt_token_ids": token_ids}, greedy(1), request_id=request_id,
                           kv_transfer_params=dict(PREFILL_PARAMS))
        out = self.wait(self.p, {request_id})[request_id]
        return out.kv_transfer_params

    def wait(self, engine: LLMEngine, request_ids: set[str],
             timeout_s: float = 30) -> dict[str, RequestOutput]:
        """Step both engines until `engine` finished every request in `request_ids`."""
        final: dict[str, RequestOutput] = {}
        deadline = time.monotonic() + timeout_s
        while len(final) < len(request_ids):
            assert time.monotonic() < deadline, f"requests {request_ids - set(final)} did not finish"
            other = self.d if engine is self.p else self.p
            other.step()
            for out in engine.step():
                if out.finished and out.request_id in request_ids:
                    final[out.request_id] = out
        return final

    def decode(self, requests: dict[str, tuple[list[int], dict[str, Any] | None]], max_tokens: int,
               timeout_s: float = 30) -> dict[str, RequestOutput]:
        for request_id, (token_ids, params) in requests.items():
            self.d.add_request({"prompt_token_ids": token_ids}, greedy(max_tokens),
                               request_id=request_id, kv_transfer_params=params)
        return self.wait(self.d, set(requests), timeout_s)

    def run(self, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, list[int]]:
        """Both legs for every prompt (all prefills first, then all decodes concurrently)."""
        params = {rid: self.prefill(tokens, f"p-{rid}") for rid, tokens in prompts.items()}
        outs = self.decode({rid: (prompts[rid], params[rid]) for rid in prompts}, max_tokens)
        return {rid: out.outputs[0].token_ids for rid, out in outs.items()}

    def settle(self, until: Callable[[], bool] | None = None, timeout_s: float = 30) -> None:
        """Step both until neither has pending work (or `until()` holds)."""
        deadline = time.monotonic() + timeout_s
        while (until is None and (self.p.has_pending_work() or self.d.has_pending_work())) or (
                until is not None and not until()):
            assert time.monotonic() < deadline, (
                f"still pending after {timeout_s} s: P {self.p.get_stats()} D {self.d.get_stats()}")
            self.step()
            time.sleep(0.001)

    def close(self) -> None:
        shutdown(self.p)
        shutdown(self.d)


def reference_tokens(engine: LLMEngine, prompts: dict[str, list[int]],
                     max_tokens: int) -> dict[str, list[int]]:
    """Greedy tokens of a single instance (no connector)."""
    for rid, tokens in prompts.items():
        engine.add_request({"prompt_token_ids": tokens}, greedy(max_tokens),
                           request_id=f"ref-{rid}-{time.monotonic_ns()}")
    final: dict[str, list[int]] = {}
    ids = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                ids[out.request_id] = out.outputs[0].token_ids
    for rid in prompts:
        match = [v for k, v in ids.items() if k.startswith(f"ref-{rid}-")]
        final[rid] = match[0]
    engine.run_until_idle()
    return final
