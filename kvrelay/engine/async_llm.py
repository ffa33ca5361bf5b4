"""AsyncLLM: an LLMEngine stepped by one background thread, fed and drained from asyncio.

Threads and ownership:
- The engine thread is the only code that touches the engine after construction (scheduler,
  runner, output processor). Torch releases the GIL while it computes, so the event loop stays
  responsive while a step runs.
- The event loop talks to it through a thread-safe command queue (add, abort, stop) and gets
  outputs back through `loop.call_soon_threadsafe` into one asyncio.Queue per request.
- The thread steps while the engine has pending work and otherwise blocks on the command queue.

Tokenization and validation run in the caller (`generate`), so bad input raises ValueError
before anything is queued. The tokenizer and the model's limits are read-only after
construction, which is what makes that safe.

Request ids: `generate(request_id=...)` uses the caller's id when it is free. An id that is
already in flight here gets a suffix (`id-1`, `id-2`, ...), so a client that reuses an id never
fails; the same happens inside the engine thread if the engine still holds a finished request
under that id (e.g. a prefill instance whose KV a decode instance has not read yet).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvrelay.engine.llm_engine import LLMEngine, PromptType
from kvrelay.outputs import RequestOutput
from kvrelay.sampling_params import SamplingParams

T = TypeVar("T")

logger = logging.getLogger(__name__)

# How long the engine thread waits for a command when it has pending work but made no progress
# (e.g. a prefill instance holding blocks until a decode instance reads them): a short nap
# instead of a busy loop of empty steps.
_IDLE_POLL_S = 0.002
_SHUTDOWN_DRAIN_S = 2.0
# An idle engine thread asks its executor this often whether its worker processes still live, so
# a worker killed between requests fails the engine (and /health) at once, not at the next request.
_IDLE_HEALTH_CHECK_S = 0.5

StatsListener = Callable[[dict[str, Any], dict[str, Any]], None]


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (crashed or shut down); no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed this request (an exception in a step, or a request-level error)."""


@dataclass
class _Stream:
    """One request's channel from the engine thread back to the event loop."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    engine_id: str | None = None  # written by the engine thread once the engine holds the request

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


@dataclass
class _Add:
    stream: _Stream
    prompt: dict[str, Any]
    params: SamplingParams
    kv_transfer_params: dict[str, Any] | None


@dataclass
class _Abort:
    stream: _Stream


@dataclass
class _Release:
    """Free the KV a prefill instance holds for a request refused before the engine saw it."""
    prompt_token_ids: list[int]
    kv_transfer_params: dict[str, Any]


@dataclass
class _Call:
    """Run `fn(engine)` between two steps; its result (or error) goes to `future`."""
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class _Stop:
    pass


class AsyncLLM:
    """Serve one LLMEngine to many concurrent asyncio callers."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self._commands: queue.Queue[_Add | _Abort | _Release | _Call | _Stop] = queue.Queue()
        self._open: dict[str, _Stream] = {}  # loop thread only: requests in flight, by id
        self._listeners: list[StatsListener] = []
        self._stats: dict[str, Any] = engine.get_stats()
        self._error: BaseException | None = None
        self._stopping = False
        # Engine thread only: the stream of each request the engine holds, by engine request id.
        self._routes: dict[str, _Stream] = {}
        self._made_no_progress = False
        # Called once, from the engine thread, if the engine crashes (the server stops on it).
        self.on_dead: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._run, name="kvrelay-engine", daemon=True)
        self._thread.start()

    # ----------------------------------------------------------------------------- public API
    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None,
                       kv_transfer_params: dict[str, Any] | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until the final one (`finished=True`).

        Raises ValueError for a bad prompt (before anything is queued), EngineDeadError when the
        engine thread is gone, RequestFailedError when the engine fails the request. Stopping
        the iteration early (or cancelling the task) aborts the request.
        """
        self._check_alive()
        prompt = self.preprocess(prompt)
        stream = _Stream(self._unique_id(request_id), asyncio.get_running_loop())
        self._open[stream.request_id] = stream
        self._commands.put(_Add(stream, prompt, params, kv_transfer_params))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine side already forgot this request
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            self._open.pop(stream.request_id, None)
            if not finished:
                self._commands.put(_Abort(stream))

    def preprocess(self, prompt: PromptType) -> dict[str, Any]:
        """Tokenize and validate `prompt` in the calling thread; ValueError if it cannot be served.
        The result is a prompt `generate` accepts without tokenizing again."""
        text, token_ids = self.engine.tokenize(prompt)
        self.engine.validate_prompt(token_ids)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def release_remote_kv(self, prompt_token_ids: list[int], kv_transfer_params: dict[str, Any]) -> None:
        """A request refused before it reached the engine frees the KV a prefill instance holds
        for it (LLMEngine.release_remote_kv, on the engine thread). Nothing when the engine is gone."""
        if self.is_alive:
            self._commands.put(_Release(list(prompt_token_ids), dict(kv_transfer_params)))

    def abort(self, request_id: str) -> None:
        """Abort a request in flight (its stream then ends with finish_reason "abort")."""
        stream = self._open.get(request_id)
        if stream is not None:
            self._commands.put(_Abort(stream))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """`fn(engine)` run on the engine thread between two steps (the engine is not
        thread-safe), e.g. `await async_llm.call(lambda e: e.reset_prefix_cache())`."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._commands.put(_Call(fn, future, loop))
        return await future

    def stats(self) -> dict[str, Any]:
        """The engine's stats as published by the engine thread after its latest step."""
        return self._stats

    def add_stats_listener(self, listener: StatsListener) -> None:
        """`listener(previous, current)` runs in the engine thread each time stats are published.
        Keep it short and thread-safe (e.g. observe a Prometheus histogram)."""
        self._listeners.append(listener)

    @property
    def dp_rank(self) -> int | None:
        """This engine's data-parallel rank; None when it is not one of several."""
        parallel = self.engine.config.parallel
        return (parallel.data_parallel_rank or 0) if parallel.data_parallel else None

    @property
    def ranks(self) -> list[AsyncLLM]:
        """The engines behind this endpoint: this one (kvrelay.engine.data_parallel has several)."""
        return [self]

    def pick_rank(self, prompt_token_ids: list[int], kv_transfer_params: dict[str, Any] | None,
                  dp_rank: int | None = None) -> AsyncLLM:
        """The engine that serves a request: this one. A rank the caller names (vLLM's
        X-data-parallel-rank) must be this engine's own: ValueError naming it otherwise."""
        own, size = self.dp_rank or 0, self.engine.config.parallel.data_parallel_size
        if dp_rank is None or dp_rank == own:
            return self
        if self.dp_rank is None:
            raise ValueError(f"data_parallel_rank {dp_rank} is out of range [0, 1): this server runs one "
                             "engine (start it with --data-parallel-size N for ranks)")
        raise ValueError(f"data_parallel_rank {dp_rank}: this server runs data-parallel rank {own} of {size} "
                         f"alone (--data-parallel-rank); send the request to rank {dp_rank}'s server")

    def health(self) -> tuple[int, dict[str, Any]]:
        """(HTTP status, body) of /health."""
        reason = self.dead_reason
        if reason is not None:
            return 503, {"status": "unhealthy", "reason": reason}
        return 200, {"status": "ok"}

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self._error is None and not self._stopping

    @property
    def crashed(self) -> bool:
        """Whether the engine thread died of an exception (not a shutdown)."""
        return self._error is not None

    @property
    def dead_reason(self) -> str | None:
        if self._error is not None:
            return f"the engine thread crashed: {type(self._error).__name__}: {self._error}"
        if not self.is_alive:
            return "the engine is shut down"
        return None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort everything, stop the engine thread and join it. Safe to call twice."""
        self._stopping = True
        if self._thread.is_alive():
            self._commands.put(_Stop())
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.error("the engine thread did not stop within %.0f s", timeout_s)

    # ----------------------------------------------------------------------------- loop side
    def _check_alive(self) -> None:
        reason = self.dead_reason
        if reason is not None:
            raise EngineDeadError(reason)

    def _unique_id(self, request_id: str | None) -> str:
        if request_id is None:
            request_id = f"req-{next(_anonymous_ids)}"
        if request_id not in self._open:
            return request_id
        return next(f"{request_id}-{n}" for n in itertools.count(1) if f"{request_id}-{n}" not in self._open)

    # ----------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        try:
            while self._serve_commands():
                if self.engine.has_pending_work():
                    self._step()
        except BaseException as e:  # noqa: BLE001 - anything here must reach the requests and the log
            self._error = e
            logger.exception("the engine thread crashed; failing every request in flight")
            self._fail_all(RequestFailedError(f"engine error: {type(e).__name__}: {e}"))
            if self.on_dead is not None:
                self.on_dead(e)
            return
        self._drain_and_close()

    def _serve_commands(self) -> bool:
        """Handle queued commands; block for one when idle. False once asked to stop."""
        try:
            if not self.engine.has_pending_work():
                command = self._wait_for_command()
            elif self._made_no_progress:
                command = self._commands.get(timeout=_IDLE_POLL_S)
            else:
                command = self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            if isinstance(command, _Stop):
                return False
            self._handle(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish_stats()  # admissions and aborts change the counts even without a step
        return True

    def _wait_for_command(self) -> _Add | _Abort | _Release | _Call | _Stop:
        """Block for the next command, checking the workers while none comes (WorkerFailedError,
        and the thread's crash path, when one died)."""
        while True:
            try:
                return self._commands.get(timeout=_IDLE_HEALTH_CHECK_S)
            except queue.Empty:
                self.engine.check_health()

    def _handle(self, command: _Add | _Abort | _Release | _Call) -> None:
        if isinstance(command, _Release):
            self.engine.release_remote_kv(command.prompt_token_ids, command.kv_transfer_params)
            return
        if isinstance(command, _Call):
            _run_call(command, self.engine)
            return
        stream = command.stream
        if isinstance(command, _Abort):
            if stream.engine_id is not None and stream.engine_id in self._routes:
                self.engine.abort_request(stream.engine_id)
            return
        engine_id = self._free_engine_id(stream.request_id)
        try:
            self.engine.add_request(command.prompt, command.params, engine_id, command.kv_transfer_params)
        except ValueError as e:
            stream.put(e)
            return
        self._routes[engine_id] = stream
        stream.engine_id = engine_id

    def _free_engine_id(self, request_id: str) -> str:
        # NOTE: the scheduler keeps a finished request's id while a connector holds its blocks.
        taken = self.engine.scheduler.requests
        candidate, n = request_id, 0
        while candidate in taken or candidate in self._routes:
            n += 1
            candidate = f"{request_id}-{n}"
        return candidate

    def _step(self) -> None:
        outputs = self.engine.step()
        for out in outputs:
            stream = self._routes.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._routes[out.request_id]
            stream.put(out)
        stats = self._publish_stats()
        self._made_no_progress = not outputs and stats.get("num_running", 0) == 0

    def _publish_stats(self) -> dict[str, Any]:
        previous, current = self._stats, self.engine.get_stats()
        current["timestamp"] = time.time()
        self._stats = current  # one reference swap: readers see the old or the new dict
        for listener in self._listeners:
            try:
                listener(previous, current)
            except Exception:
                logger.exception("a stats listener failed")
        return current

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._routes.values():
            stream.put(error)
        self._routes.clear()
        while True:  # requests queued but never added
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.stream.put(error)
            elif isinstance(command, _Call):
                _settle(command, error=error)

    def _drain_and_close(self) -> None:
        """Shutdown: abort what is in flight, let transfers settle briefly, release the engine."""
        try:
            self.engine.abort_request(list(self._routes))
            deadline = time.monotonic() + _SHUTDOWN_DRAIN_S
            while self.engine.has_pending_work() and time.monotonic() < deadline:
                self.engine.step()
            self._publish_stats()
        except Exception:
            logger.exception("error while draining the engine at shutdown")
        self._fail_all(EngineDeadError("the server is shutting down"))
        close = getattr(self.engine, "shutdown", None)
        if callable(close):
            try:
                close()
            except Exception:
                logger.exception("error while shutting the engine down")


def _run_call(command: _Call, engine: LLMEngine) -> None:
    try:
        result = command.fn(engine)
    except Exception as e:  # the caller's error, not the engine's
        _settle(command, error=e)
        return
    _settle(command, result=result)


def _settle(command: _Call, result: Any = None, error: BaseException | None = None) -> None:
    """Hand the outcome to the caller's event loop (from the engine thread)."""
    def done() -> None:
        if command.future.done():  # the caller gave up (cancelled)
            return
        if error is not None:
            command.future.set_exception(error)
        else:
            command.future.set_result(result)

    try:
        command.loop.call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed: nobody is waiting
        pass


_anonymous_ids = itertools.count()
