"""PoolManager: the proxy's prefill and decode pools while they change, and what they cache.

    members    instances join (`add`: it must answer /health first) and leave (`drain`: no new
               legs, removed once nothing in flight needs it, including decode legs still
               reading a prefill instance's KV)
    health     every `health_interval` seconds each instance's /health is asked: a refused
               connection or an error status takes it out of routing at once, so does a leg
               that cannot connect; `health_timeouts_to_drop` checks without an answer in a
               row too (a busy instance can be slow to answer). It comes back when it answers.
    KV index   with a kv-aware policy, each instance's KV events are followed: what it is (kvrelay,
               vLLM) and where it publishes come from the instance itself (routing/instances.py)
               or the admin API; its index starts empty when it joins or comes back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import httpx

from kvrelay.disagg.backends import Backend, BackendPool, InstanceState
from kvrelay.disagg.proxy_config import ProxyConfig
from kvrelay.disagg.push_mode import check_push_config
from kvrelay.disagg.routing.instances import discover
from kvrelay.disagg.routing.kv_index import KVIndex
from kvrelay.disagg.routing.policies import create_policy
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
        self._client: httpx.AsyncClient | None = None
        self._tasks: list[asyncio.Task[None]] = []

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

    async def start(self, client: httpx.AsyncClient) -> None:
        self._client = client
        if self.index is not None and self.subscriber is None:
            self.subscriber = KVEventSubscriber(self.index)
        for backend in self.members():
            await self._track_index(backend)
        if self.config.health_interval > 0:
            self._tasks.append(asyncio.ensure_future(self._health_loop()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
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
        healthy, error = await self.check(url)
        if not healthy:
            raise ConnectionError(f"{url} did not answer its health check: {error}")
        self._refuse_member(url)  # again: another add may have won while we waited
        backend = pool.add(url, kv_address=kv_address, events=events)
        await self._track_index(backend)
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
                logger.info("%s instance %s left the pool", backend.role, backend.url)

    def mark_down(self, backend: Backend, error: str) -> None:
        """A leg could not reach `backend`: out of routing until a health check answers."""
        if backend.state is InstanceState.ACTIVE:
            logger.warning("%s instance %s is down (%s)", backend.role, backend.url, error)
            backend.state = InstanceState.DOWN

    # ------------------------------------------------------------------ health

    async def check(self, url: str) -> tuple[bool, str | None]:
        """(healthy, why not): one GET /health."""
        try:
            response = await self.client.get(url + "/health", timeout=self.config.health_timeout,
                                             headers=self._auth_headers())
        except httpx.TimeoutException:
            return False, "timeout"
        except httpx.TransportError as e:
            return False, f"unreachable: {e!r}"
        if response.status_code != 200:
            return False, f"HTTP {response.status_code}"
        return True, None

    async def check_all(self) -> None:
        backends = list(self.members())
        results = await asyncio.gather(*(self.check(b.url) for b in backends))
        for backend, (healthy, error) in zip(backends, results, strict=True):
            await self._apply_check(backend, healthy, error)
        self.reap()

    async def _apply_check(self, backend: Backend, healthy: bool, error: str | None) -> None:
        if healthy:
            backend.health_failures = 0
            if backend.state is InstanceState.DOWN:
                backend.state = InstanceState.ACTIVE
                logger.info("%s instance %s answers again: back in the pool", backend.role, backend.url)
                await self._track_index(backend)  # it may have restarted with an empty cache
            elif backend.events is None and self.index is not None:
                await self._track_index(backend)  # it did not say where it publishes: ask again
            return
        backend.health_failures += 1
        timed_out = error == "timeout"
        if not timed_out or backend.health_failures >= self.config.health_timeouts_to_drop:
            self.mark_down(backend, error or "unhealthy")

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not end the checks for good
                logger.exception("health checks failed")

    # ------------------------------------------------------------------ KV events

    async def _track_index(self, backend: Backend) -> None:
        """Start the instance's index empty and follow its events (asking the instance what
        it is, and where it publishes if nobody said so)."""
        if self.index is None or self.subscriber is None:
            return
        info = await discover(self.client, backend.url, self._auth_headers(), self.config.health_timeout,
                              self.config.hash_settings)
        backend.engine = info.engine
        asked_before = self.index.status(backend.url).reason == "no events endpoint"
        if backend.events is None:
            backend.events = info.events
            if backend.events is None and asked_before:
                return  # asked before, still nothing: keep the entry (and the log quiet)
        if backend.events is None:
            logger.warning("%s (%s) publishes no KV events: kv-aware routing weighs it by load alone",
                           backend.url, info.engine)
        self.index.track(backend.url, subscribed=backend.events is not None, block_size=info.block_size,
                         schemes=info.schemes)
        if backend.events is not None:
            self.subscriber.add(backend.url, backend.events)

    def _untrack_index(self, backend: Backend) -> None:
        if self.index is not None and self.subscriber is not None:
            self.subscriber.remove(backend.url)
            self.index.forget(backend.url)

    # ------------------------------------------------------------------ helpers

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise RuntimeError("PoolManager.start() was not called")
        return self._client

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

