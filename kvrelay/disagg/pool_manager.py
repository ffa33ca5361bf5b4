"""PoolManager: the proxy's prefill and decode pools while they change, and what they cache.

    members    instances join (`add`: it must answer /health first) and leave (`drain`: no new
               legs, removed once nothing in flight needs it, including decode legs still
               reading a prefill instance's KV). At join the proxy asks what each one runs
               (instance_info.py, on the checks' connections) and refuses one whose transfer
               mode is not its own: at start, through `add`, or when it first answers a check
    health     every `health_interval` seconds each instance's /health is asked, on a
               connection of its own: a refused connection or an error status takes it out of
               routing at once, so does a leg that cannot connect; timeouts count as far as it
               looks dead (kvrelay.disagg.health: bytes on its legs are proof of life). It comes
               back when it answers. A request that finds no active instance of a role asks
               the down ones again first (`choose`).
    KV index   with a kv-aware policy, each instance's KV events are followed: what it is (kvrelay,
               vLLM) and where it publishes come from the instance itself (routing/instances.py)
               or the admin API; its index starts empty when it joins or comes back. An instance
               with data-parallel ranks has a stream and an index entry per rank.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx

from kvrelay.disagg.backends import Backend, BackendPool, InstanceState, NoInstanceError
from kvrelay.disagg.connections import Connections, checks_client, origin
from kvrelay.disagg.health import CheckResult, DownCause, check_health, failure_reason, timeout_weight
from kvrelay.disagg.instance_info import TransferModeError, fetch_instance_info, mismatch, refusal
from kvrelay.disagg.proxy_config import ProxyConfig
from kvrelay.disagg.push_mode import check_push_config
from kvrelay.disagg.routing.instances import discover
from kvrelay.disagg.routing.kv_index import KVIndex, rank_key
from kvrelay.disagg.routing.policies import Decision, create_policy
from kvrelay.disagg.routing.prompt import PromptBlocks
from kvrelay.kv_events.subscriber import KVEventSubscriber, StreamAddress

logger = logging.getLogger(__name__)


class PoolManager:
    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        self.index = KVIndex(config.kv_index_stale_after) if config.kv_aware else None
        self.subscriber: KVEventSubscriber | None = None  # its thread starts with start()
        self.prefill = BackendPool("prefill", config.prefill_urls,
                                   create_policy(config.prefill_routing, "prefill", self.index),
                                   allow_empty=config.aggregated)
        # NOTE: without P/D the decode instances compute the prompt: weighed as prefill ones are.
        self.decode = BackendPool("decode", config.decode_urls,
                                  create_policy(config.decode_routing, "decode", self.index,
                                                computes_prompt=config.aggregated))
        kv_addresses = check_push_config(config.transfer_mode, config.prefill_urls,
                                         config.prefill_kv_addresses)
        for backend in self.prefill.backends:
            backend.kv_address = kv_addresses.get(backend.url)
        self._connections: Connections | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._rechecks: dict[str, asyncio.Future[list[str]]] = {}  # role -> the re-check running
        self._by_origin: dict[str, Backend | None] = {}  # where leg bytes come from (note_bytes)
        self.downs: Counter[tuple[str, str, str]] = Counter()  # (role, url, reason) -> mark-downs

    @property
    def pools(self) -> dict[str, BackendPool]:
        return {"prefill": self.prefill, "decode": self.decode}

    def members(self) -> Iterator[Backend]:
        for pool in self.pools.values():
            yield from pool.backends

    def find(self, url: str) -> Backend | None:
        url = url.rstrip("/")
        return next((b for b in self.members() if b.url == url), None)

    # ------------------------------------------------------------------ lifecycle

    async def start(self, connections: Connections) -> None:
        self._connections = connections
        await self.learn_instances()
        if self.index is not None and self.subscriber is None:
            self.subscriber = KVEventSubscriber(self.index)
        silent = [b for b in self.members() if await self._track_index(b)]
        _say_no_events(silent)
        if self.config.health_interval > 0:
            self._tasks.append(asyncio.ensure_future(self._health_loop()))

    async def close(self) -> None:
        pending: list[asyncio.Future[Any]] = [*self._tasks, *self._rechecks.values()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._tasks.clear()
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None

    # ------------------------------------------------------------------ membership

    async def add(self, role: str, url: str, kv_address: tuple[str, int] | None = None,
                  events: StreamAddress | None = None) -> Backend:
        """Admit a healthy instance. ValueError (bad input), KeyError (already a member),
        ConnectionError (it does not answer /health)."""
        pool = self.pools[role]
        url = url.rstrip("/")
        self._refuse_member(url)
        result = await self.check(url)
        if not result.healthy:
            raise ConnectionError(f"{url} did not answer its health check: {result.error}")
        info = await fetch_instance_info(self.connections.checks, url, self._auth_headers(),
                                         self.config.health_timeout)
        problem = mismatch(role, url, info, self.config.transfer_mode) if info else None
        if problem is not None:
            raise TransferModeError(refusal([problem], self.config.transfer_mode, joining=True))
        self._refuse_member(url)  # again: another add may have won while we waited
        backend = pool.add(url, kv_address=kv_address, events=events)
        backend.info = info
        self._by_origin.clear()
        if await self._track_index(backend):
            _say_no_events([backend])
        logger.info("%s instance %s joined the pool", role, url)
        return backend

    def _refuse_member(self, url: str) -> None:
        existing = self.find(url)
        if existing is not None:
            raise KeyError(f"{url} is already in the pool (as a {existing.role} instance, "
                           f"{existing.state.value})")

    def drain(self, url: str, force: bool = False) -> Backend:
        """Stop routing to `url`; it leaves once idle. KeyError (unknown), ValueError (already
        draining, or the last active instance of its role without `force`)."""
        backend = self.find(url)
        if backend is None:
            raise KeyError(f"{url} is not in the pool")
        pool = self.pools[backend.role]
        others = [b for b in pool.candidates() if b is not backend]
        if backend.state is InstanceState.ACTIVE and not others and not force:
            raise ValueError(f"{url} is the last active {backend.role} instance; draining it leaves none "
                             "(add another first, or pass force)")
        pool.drain(url)
        logger.info("%s instance %s is draining (%d legs in flight, %d readers)", backend.role, url,
                    backend.in_flight, backend.readers)
        self.reap()
        return backend

    def reap(self) -> None:
        """Remove the drained instances that nothing needs any more."""
        for pool in self.pools.values():
            for backend in pool.remove_idle_drained():
                self._untrack_index(backend)
                self._by_origin.clear()
                logger.info("%s instance %s left the pool", backend.role, backend.url)

    async def learn_instances(self, client: httpx.AsyncClient | None = None) -> None:
        """Ask every member what it runs (with `client`, else the checks' connections: a
        question the proxy asks on its own). TransferModeError naming each one that runs another
        transfer mode than this proxy; one that does not answer is asked again when it does."""
        answers = await asyncio.gather(*(self._learn(b, client) for b in self.members()))
        problems = [problem for problem in answers if problem is not None]
        if problems:
            raise TransferModeError(refusal(problems, self.config.transfer_mode))

    async def _learn(self, backend: Backend, client: httpx.AsyncClient | None = None) -> str | None:
        info = await fetch_instance_info(client or self.connections.checks, backend.url,
                                         self._auth_headers(), self.config.health_timeout)
        if info is None:
            return None
        backend.info = info
        return mismatch(backend.role, backend.url, info, self.config.transfer_mode)

    def _refuse(self, backend: Backend, problem: str) -> None:
        """Take a member that runs another transfer mode out of the pool."""
        logger.error("%s; it leaves the pool", refusal([problem], self.config.transfer_mode, joining=True))
        if backend.state is not InstanceState.DRAINING:
            self.pools[backend.role].drain(backend.url)

    def mark_down(self, backend: Backend, cause: DownCause) -> None:
        """Out of routing until a health check answers; logged with its cause, counted by reason."""
        if backend.state is not InstanceState.ACTIVE:
            return
        backend.state = InstanceState.DOWN
        self.downs[(backend.role, backend.url, cause.reason)] += 1
        logger.warning("%s instance %s is down: %s", backend.role, backend.url, cause.describe())

    def leg_failed(self, backend: Backend, leg: str, error: httpx.TransportError) -> None:
        """A leg to `backend` failed after its one stale-connection retry (connections.py). Only
        a refused connection, always a fresh one, takes the instance out; the rest is the leg's
        error alone (the health checks judge the instance)."""
        if isinstance(error, httpx.ConnectError):
            self.mark_down(backend, DownCause(failure_reason(error), repr(error), leg, reused=False,
                                              failed_checks=backend.health_failures))

    def note_bytes(self, source: str) -> None:
        """Bytes arrived on a leg from `source` (an origin, connections.py): proof of life."""
        if source not in self._by_origin:
            self._by_origin = {origin(b.url): b for b in self.members()}
            self._by_origin.setdefault(source, None)  # no member there (any more): ask once
        backend = self._by_origin[source]
        if backend is not None:
            backend.last_bytes_at = time.monotonic()

    async def choose(self, role: str, prompt: PromptBlocks | None = None) -> Decision:
        """The role's pool's pick. When no instance of it is active, the down ones are asked
        again first (one failure must not leave a role empty); NoInstanceError names each one
        tried and why it is still out."""
        pool = self.pools[role]
        try:
            return pool.choose(prompt)
        except NoInstanceError:
            pass
        tried = await self.recheck(role)
        try:
            return pool.choose(prompt)
        except NoInstanceError as e:
            detail = f"; re-checked just now: {', '.join(tried)}" if tried else ""
            raise NoInstanceError(f"{e}{detail}") from None

    async def recheck(self, role: str) -> list[str]:
        """Health-check every down instance of `role` now (concurrent callers share one round);
        those that answer are back. Returns "url (why)" for each one still out."""
        running = self._rechecks.get(role)
        if running is None or running.done():
            running = self._rechecks[role] = asyncio.ensure_future(self._recheck(role))
        return await asyncio.shield(running)

    async def _recheck(self, role: str) -> list[str]:
        down = [b for b in self.pools[role].backends if b.state is InstanceState.DOWN]
        started = time.monotonic()
        results = await asyncio.gather(*(self.check(b.url) for b in down))
        for backend, result in zip(down, results, strict=True):
            await self._apply_check(backend, result, started)
        return [f"{b.url} ({r.error})" for b, r in zip(down, results, strict=True) if not r.healthy]

    # ------------------------------------------------------------------ health

    async def check(self, url: str) -> CheckResult:
        """One GET /health, on a connection of its own."""
        return await check_health(self.connections.checks, url, self.config.health_timeout,
                                  self._auth_headers())

    async def check_all(self) -> None:
        backends = list(self.members())
        started = time.monotonic()
        results = await asyncio.gather(*(self.check(b.url) for b in backends))
        for backend, result in zip(backends, results, strict=True):
            await self._apply_check(backend, result, started)
        self.reap()

    async def _apply_check(self, backend: Backend, result: CheckResult, started: float) -> None:
        if result.healthy:
            backend.health_failures, backend.missed_checks = 0, 0.0
            if backend.info is None or backend.state is InstanceState.DOWN:  # new, or maybe restarted
                problem = await self._learn(backend)
                if problem is not None:
                    self._refuse(backend, problem)
                    return
            if backend.state is InstanceState.DOWN:
                backend.state = InstanceState.ACTIVE
                logger.info("%s instance %s answers again: back in the pool", backend.role, backend.url)
                if await self._track_index(backend):  # it may have restarted with an empty cache
                    _say_no_events([backend])
            elif backend.events is None and self.index is not None:
                await self._track_index(backend)  # it did not say where it publishes: ask again
            return
        backend.health_failures += 1
        if result.reason == "timeout":
            weight = timeout_weight(backend, started, self.config.health_interval)
            backend.missed_checks = backend.missed_checks + weight if weight else 0.0
            if backend.missed_checks < self.config.health_timeouts_to_drop:
                logger.info("%s instance %s: health check timed out (%d in a row; counted %.1f of %d)",
                            backend.role, backend.url, backend.health_failures, backend.missed_checks,
                            self.config.health_timeouts_to_drop)
                return
        cause = DownCause(result.reason or "unhealthy", result.error or "unhealthy", "health check",
                          reused=False, failed_checks=backend.health_failures)
        self.mark_down(backend, cause)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not end the checks for good
                logger.exception("health checks failed")

    # ------------------------------------------------------------------ KV events

    async def _track_index(self, backend: Backend) -> bool:
        """Start the instance's index empty and follow its events (asking the instance what
        it is, and where it publishes if nobody said so). True when it was just found to
        publish none (the caller says so: _say_no_events)."""
        if self.index is None or self.subscriber is None:
            return False
        found = await discover(self.connections.checks, backend.url, self._auth_headers(),
                               self.config.health_timeout, self.config.hash_settings)
        backend.engine = found.engine
        asked_before = self.index.status(backend.url).reason == "no events endpoint"
        if backend.events is None:
            backend.events, backend.rank_events = found.events, found.rank_events
            if backend.events is None and asked_before:
                return False  # asked before, still nothing: keep the entry (and the log quiet)
        self.index.track(backend.url, subscribed=backend.events is not None, block_size=found.block_size,
                         schemes=found.schemes)
        if backend.events is not None:
            self.subscriber.add(backend.url, backend.events)
        for dp_rank, address in backend.rank_events.items():  # (instance, rank): one entry each
            self.index.track(rank_key(backend.url, dp_rank), subscribed=True, block_size=found.block_size,
                             schemes=found.schemes)
            self.subscriber.add(rank_key(backend.url, dp_rank), address)
        return backend.events is None

    def _untrack_index(self, backend: Backend) -> None:
        if self.index is not None and self.subscriber is not None:
            for key in backend.index_keys:
                self.subscriber.remove(key)
                self.index.forget(key)

    # ------------------------------------------------------------------ helpers

    @property
    def connections(self) -> Connections:
        if self._connections is None:
            raise RuntimeError("PoolManager.start() was not called")
        return self._connections

    def _auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    def describe(self, backend: Backend) -> dict[str, Any]:
        """One instance as the admin API lists it."""
        report: dict[str, Any] = {"url": backend.url, "role": backend.role, "state": backend.state.value,
                                  "in_flight": backend.in_flight, "readers": backend.readers,
                                  "queued_tokens": backend.queued_tokens}
        if backend.kv_address is not None:
            report["kv_address"] = f"{backend.kv_address[0]}:{backend.kv_address[1]}"
        if self.index is not None:
            status = self.index.status(backend.url)
            report["kv_index"] = {"usable": status.usable, "reason": status.reason, "blocks": status.blocks,
                                  "resets": status.resets, "hash_scheme": status.scheme,
                                  "hashes": status.hashes}
        if backend.engine is not None:
            report["engine"] = backend.engine
        if backend.events is not None:
            report["kv_events"] = {"endpoint": backend.events.endpoint,
                                   "replay_endpoint": backend.events.replay_endpoint,
                                   "topic": backend.events.topic}
        return report


async def check_instances(config: ProxyConfig) -> None:
    """What `kvrelay proxy` asks before it serves: TransferModeError if an instance runs another
    transfer mode (the app's start asks again, for those who build it themselves)."""
    timeout = httpx.Timeout(config.decode_timeout, connect=config.connect_timeout)
    async with checks_client(config.max_connections, timeout) as client:
        await PoolManager(config).learn_instances(client)


def _say_no_events(backends: list[Backend]) -> None:
    """One line for every instance found to publish no KV events, with what turns them on."""
    if not backends:
        return
    named = ", ".join(f"{b.url} ({b.engine})" if b.engine else b.url for b in backends)
    logger.info("kv-aware routing weighs %s by load alone: %s no KV events. To route by cached prefix, "
                "start each instance (`kvrelay serve`, or vLLM) with --kv-events-config "
                "'{\"enable_kv_cache_events\": true, \"endpoint\": \"tcp://*:PORT\"}' (a free PORT each); "
                "another engine's endpoint is given to the admin API (docs/routing.md)",
                named, "it publishes" if len(backends) == 1 else "they publish")
