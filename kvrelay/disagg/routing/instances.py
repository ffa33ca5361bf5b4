"""What an instance is, told by the instance itself: its engine, where it publishes KV events,
and how it hashes blocks.

    kvrelay   GET /kv_events answers {"enabled", "endpoint", "replay_endpoint", "topic",
              "block_size"}: kvrelay's own block hash
    vLLM      GET /kv_event_sources answers its publishers' configs by data-parallel rank (the
              `--kv-events-config` it started with), or, on a vLLM without that route, GET
              /v1/models names "vllm" as the owner: vLLM's block hash, its algorithm and seed
              among the candidates the proxy was configured with (routing/hash_schemes.py)
    other     an engine that says neither: every scheme is a candidate

The candidates are checked against the instance's own events (KVIndex): the first BlockStored
that can tell picks the scheme that reproduces it, or marks the instance's hashes as not
reproducible (it is then routed by load).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvrelay.disagg.routing.hash_schemes import KVRELAY_SCHEME, BlockHashScheme, vllm_candidates
from kvrelay.kv_events.subscriber import StreamAddress

logger = logging.getLogger(__name__)

ENGINES = ("kvrelay", "vllm", "unknown")


@dataclass(frozen=True)
class HashSettings:
    """What the proxy is told of its vLLM instances' hashing (None: find it out)."""

    prefix_caching_hash_algo: str | None = None  # vLLM's --prefix-caching-hash-algo
    pythonhashseed: str | None = None  # the PYTHONHASHSEED the vLLM instances run with

    def vllm_schemes(self) -> tuple[BlockHashScheme, ...]:
        return tuple(vllm_candidates(self.prefix_caching_hash_algo, self.pythonhashseed))


@dataclass(frozen=True)
class InstanceInfo:
    engine: str  # one of ENGINES
    events: StreamAddress | None  # where it publishes (rank 0), if it says so
    block_size: int | None
    schemes: tuple[BlockHashScheme, ...]  # how it may hash blocks, the likeliest first
    rank_events: dict[int, StreamAddress] = field(default_factory=dict)  # data-parallel ranks above 0


async def discover(client: httpx.AsyncClient, url: str, headers: dict[str, str], timeout: float,
                   hashing: HashSettings) -> InstanceInfo:
    """Ask the instance at `url` what it is (see the module's docstring)."""
    answer = await _get_json(client, url + "/kv_events", headers, timeout)
    if isinstance(answer, dict) and "enabled" in answer:
        events = _kvrelay_events(url, answer)
        return InstanceInfo("kvrelay", events, _int_or_none(answer.get("block_size")), (KVRELAY_SCHEME,),
                            _kvrelay_ranks(url, answer, events))
    sources = await _get_json(client, url + "/kv_event_sources", headers, timeout)
    if isinstance(sources, dict):
        ranks = _vllm_events(url, sources)
        return InstanceInfo("vllm", ranks.pop(0, None), None, hashing.vllm_schemes(), ranks)
    models = await _get_json(client, url + "/v1/models", headers, timeout)
    data = models.get("data") if isinstance(models, dict) else None
    if isinstance(data, list) and any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in data):
        return InstanceInfo("vllm", None, None, hashing.vllm_schemes())
    return InstanceInfo("unknown", None, None, (KVRELAY_SCHEME, *hashing.vllm_schemes()))


def _kvrelay_events(url: str, answer: dict[str, Any]) -> StreamAddress | None:
    if not answer.get("enabled") or not isinstance(answer.get("endpoint"), str):
        return None
    return _address(url, answer["endpoint"], answer.get("replay_endpoint"), answer.get("topic"))


def _kvrelay_ranks(url: str, answer: dict[str, Any],
                   events: StreamAddress | None) -> dict[int, StreamAddress]:
    """Where a kvrelay instance's data-parallel ranks above 0 publish (its /kv_events "ranks"),
    less the stream followed as the instance's own (a rank served alone)."""
    if events is None or not isinstance(answer.get("ranks"), list):
        return {}
    streams = {}
    for entry in answer["ranks"]:
        if not isinstance(entry, dict):
            continue
        dp_rank, endpoint = entry.get("dp_rank"), entry.get("endpoint")
        if isinstance(dp_rank, int) and dp_rank > 0 and isinstance(endpoint, str):
            streams[dp_rank] = _address(url, endpoint, entry.get("replay_endpoint"), events.topic)
    return {rank: stream for rank, stream in streams.items() if stream.endpoint != events.endpoint}


def _vllm_events(url: str, sources: dict[str, Any]) -> dict[int, StreamAddress]:
    """Each data-parallel rank's publisher (vLLM's /kv_event_sources, keyed by rank)."""
    streams = {}
    for rank, config in sources.items():
        if not str(rank).isdigit() or not isinstance(config, dict):
            continue
        if not config.get("enable_kv_cache_events"):
            continue
        if config.get("publisher", "zmq") != "zmq" or not isinstance(config.get("endpoint"), str):
            continue
        streams[int(rank)] = _address(url, config["endpoint"], config.get("replay_endpoint"),
                                      config.get("topic"))
    return streams


def _address(url: str, endpoint: str, replay: Any, topic: Any) -> StreamAddress:
    host = urlsplit(url).hostname or "127.0.0.1"
    return StreamAddress(connectable(endpoint, host),
                         connectable(replay, host) if isinstance(replay, str) and replay else None,
                         topic if isinstance(topic, str) else "")


def connectable(endpoint: str, host: str) -> str:
    """A bound ZeroMQ address as a peer connects to it: a wildcard host becomes `host`."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint
    bound_host, colon, port = rest.rpartition(":")
    if bound_host in ("*", "0.0.0.0", "[::]", "::"):
        return f"tcp://{host}{colon}{port}"
    return endpoint


async def _get_json(client: httpx.AsyncClient, url: str, headers: dict[str, str], timeout: float) -> Any:
    try:
        response = await client.get(url, headers=headers, timeout=timeout)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
