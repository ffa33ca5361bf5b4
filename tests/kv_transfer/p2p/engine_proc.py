"""An engine of the tiny model in its own process (multiprocessing spawn), driven over a pipe.

The child steps its engine whenever it has work and answers commands between steps:
("add", request_id, token_ids, max_tokens, kv_transfer_params), ("abort", request_id),
("stats",), ("stop",). Finished requests come back unasked as ("output", request_id, {...}).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
from typing import Any


def _serve(conn: Any, kv_transfer_config: dict[str, Any], env: dict[str, str],
           engine_options: dict[str, Any] | None = None) -> None:
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    from tests.kv_transfer.p2p.pd import greedy, kv_threads, make_engine, shutdown

    if env.get("KVRELAY_TEST_TRANSPORT") == "inprocess":  # cannot reach other processes: reads fail
        from kvrelay.kv_transfer.p2p import settings
        from tests.kv_transfer.p2p.fake_transport import InProcessTransport

        settings.make_transport = lambda config, transfer_config, secret: InProcessTransport()  # type: ignore[assignment]

    if "KVRELAY_TEST_NIXL_IDLE_S" in env:  # how slowly the NIXL progress thread polls when idle
        from kvrelay.kv_transfer.transport import nixl

        nixl.IDLE_INTERVAL_S = float(env["KVRELAY_TEST_NIXL_IDLE_S"])
    engine = make_engine(kv_transfer_config, **(engine_options or {}))
    conn.send(("ready", None))
    while True:
        busy = engine.has_pending_work()
        if conn.poll(0 if busy else 0.005):
            command, *args = conn.recv()
            if command == "add":
                request_id, token_ids, max_tokens, params = args
                engine.add_request({"prompt_token_ids": token_ids}, greedy(max_tokens),
                                   request_id=request_id, kv_transfer_params=params)
            elif command == "abort":
                engine.abort_request(args[0])
            elif command == "stats":
                conn.send(("stats", {**engine.get_stats(), "blocks_in_use": engine.blocks_in_use}))
            elif command == "stop":
                shutdown(engine)
                time.sleep(0.1)
                conn.send(("stopped", [t.name for t in kv_threads()]))
                return
        if busy:
            for out in engine.step():
                if out.finished:
                    conn.send(("output", out.request_id, {
                        "token_ids": out.outputs[0].token_ids, "finish_reason": out.outputs[0].finish_reason,
                        "kv_transfer_params": out.kv_transfer_params, "error": out.error}))


class EngineProcess:
    def __init__(self, kv_transfer_config: dict[str, Any], env: dict[str, str] | None = None,
                 start_timeout_s: float = 120, engine_options: dict[str, Any] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, kv_transfer_config, env or {}, engine_options),
                                   daemon=True)
        self.process.start()
        self._outputs: dict[str, dict[str, Any]] = {}
        self._expect("ready", start_timeout_s)

    def _expect(self, kind: str, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while True:
            message = self._receive(deadline, f"no {kind!r} from the engine process within {timeout_s} s")
            if message[0] == kind:
                return message[1]

    def _receive(self, deadline: float, error: str) -> tuple[Any, ...]:
        while not self._conn.poll(0.2):
            if time.monotonic() > deadline:
                raise TimeoutError(error)
            if not self.process.is_alive():
                raise RuntimeError(f"the engine process died (exit code {self.process.exitcode})")
        message = self._conn.recv()
        if message[0] == "output":
            self._outputs[message[1]] = message[2]
        return message  # type: ignore[no-any-return]

    def add(self, request_id: str, token_ids: list[int], max_tokens: int,
            params: dict[str, Any] | None = None) -> None:
        self._conn.send(("add", request_id, token_ids, max_tokens, params))

    def result(self, request_id: str, timeout_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while request_id not in self._outputs:
            self._receive(deadline, f"request {request_id} did not finish within {timeout_s} s")
        return self._outputs.pop(request_id)

    def generate(self, request_id: str, token_ids: list[int], max_tokens: int,
                 params: dict[str, Any] | None = None) -> dict[str, Any]:
        self.add(request_id, token_ids, max_tokens, params)
        return self.result(request_id)

    def stats(self) -> dict[str, Any]:
        self._conn.send(("stats",))
        return self._expect("stats", 30)  # type: ignore[no-any-return]

    def wait_idle(self, timeout_s: float = 30) -> dict[str, Any]:
        """Poll until no block is in use; returns the last stats."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats["blocks_in_use"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def stop(self) -> list[str]:
        """Shut the engine down; returns the names of side-channel threads still alive."""
        self._conn.send(("stop",))
        leftover = self._expect("stopped", 30)
        self.process.join(timeout=10)
        return leftover  # type: ignore[no-any-return]

    def kill(self) -> None:
        self.process.kill()
        self.process.join(timeout=10)
