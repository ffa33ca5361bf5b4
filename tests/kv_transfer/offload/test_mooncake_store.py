"""The Mooncake Store tier on its own, against a real mooncake_master on loopback."""

from __future__ import annotations

import os
import time

import pytest

from kvrelay.kv_transfer.offload import OffloadStats, TieredStore, TierError, encode_chunk

pytestmark = pytest.mark.timeout(120)


def _tier(url: str, stats: OffloadStats | None = None, ttl_seconds: float = 0):  # type: ignore[no-untyped-def]
    from kvrelay.kv_transfer.offload.tiers.mooncake_store import MooncakeStoreTier

    return MooncakeStoreTier(url, stats or OffloadStats(), ttl_seconds=ttl_seconds)


def test_url_options_are_parsed_and_bad_ones_named():
    from kvrelay.kv_transfer.offload.tiers.mooncake_store import parse_url

    url = parse_url("mooncakestore://127.0.0.1:5000?segment=32MiB&buffer=4MiB&protocol=rdma&device=mlx5_0")
    assert (url.master, url.local_host, url.segment_bytes, url.buffer_bytes, url.protocol, url.device) == (
        "127.0.0.1:5000", "127.0.0.1", 32 * 1024**2, 4 * 1024**2, "rdma", "mlx5_0")
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_url("mooncakestore://127.0.0.1")
    with pytest.raises(ValueError, match="colour"):
        parse_url("mooncakestore://127.0.0.1:5000?colour=blue")
    with pytest.raises(ValueError, match="16MiB"):
        parse_url("mooncakestore://127.0.0.1:5000?segment=1MiB")
    with pytest.raises(ValueError, match="'udp'"):
        parse_url("mooncakestore://127.0.0.1:5000?protocol=udp")


def test_blobs_round_trip_are_replaced_and_removed(mooncake_master):
    stats = OffloadStats()
    tier = _tier(mooncake_master.url + "?segment=16MiB&buffer=8MiB", stats)
    try:
        first, second = os.urandom(3 * 1024**2 + 5), os.urandom(1000)  # unaligned sizes
        tier.put([("a", first), ("b", bytearray(second))])
        assert tier.contains(["a", "b", "c"]) == [True, True, False]
        got = tier.get(["b", "c", "a"])
        assert [bytes(b) if b is not None else None for b in got] == [second, None, first]
        tier.put([("a", second)])
        assert bytes(tier.get(["a"])[0]) == second
        tier.remove(["a", "never-stored"])
        assert tier.contains(["a", "b"]) == [False, True]
        counts = stats.take()
        assert counts["offload_mooncake_bytes_written"] == len(first) + 2 * len(second)
    finally:
        tier.close()


def test_another_client_reads_what_one_stored(mooncake_master):
    writer = _tier(mooncake_master.url + "?segment=16MiB&buffer=8MiB")
    reader = _tier(mooncake_master.url + "?segment=0&buffer=8MiB")  # holds no segment of its own
    try:
        blob = os.urandom(256 * 1024)
        writer.put([("shared", blob)])
        assert bytes(reader.get(["shared"])[0]) == blob
    finally:
        reader.close()
        writer.close()


def test_an_expired_object_is_a_miss_and_is_removed(mooncake_master):
    stats = OffloadStats()
    tier = _tier(mooncake_master.url + "?segment=16MiB&buffer=8MiB", stats, ttl_seconds=0.3)
    try:
        tier.put([("old", b"x" * 100)])
        assert tier.get(["old"])[0] is not None
        time.sleep(0.6)
        assert tier.get(["old"]) == [None]
        assert stats.take()["offload_mooncake_expired"] == 1
        assert tier.contains(["old"]) == [False]
    finally:
        tier.close()


def test_a_full_pool_evicts_old_objects_and_keeps_accepting_writes(mooncake_master):
    stats = OffloadStats()
    tier = _tier(mooncake_master.url + "?segment=16MiB&buffer=4MiB", stats)
    try:
        blob = os.urandom(1024**2)
        names = [f"chunk-{i}" for i in range(48)]  # 48 MiB into a 16 MiB pool
        for name in names:
            tier.put([(name, blob)])
            time.sleep(0.02)  # the master evicts in the background
        present = tier.contains(names)
        assert not all(present), "a 16 MiB pool cannot hold 48 MiB"
        assert any(present[-4:]), "recent writes land once the master evicted older objects"
        kept = [n for n, p in zip(names, present, strict=True) if p]
        assert all(bytes(b) == blob for b in tier.get(kept) if b is not None)
    finally:
        tier.close()


def test_master_down_is_a_tier_error_skipped_for_retry_seconds_then_recovered(mooncake_master):
    stats = OffloadStats()
    tier = _tier(mooncake_master.url + "?segment=16MiB&buffer=8MiB", stats)
    key = "k" * 16
    blob = encode_chunk(key, "fp", memoryview(os.urandom(4096)))
    store = TieredStore([tier], "fp", 4096, stats, retry_seconds=0.3)
    try:
        assert store.put(key, blob)
        mooncake_master.stop()
        with pytest.raises(TierError):
            tier.contains([key])
        with pytest.raises(TierError):
            tier.get([key])
        assert store.lookup([key]) == 0 and store.get_many([key]) == [None]
        mooncake_master.start()
        deadline = time.monotonic() + 30
        # The client reconnects and mounts its segment again by itself; the old objects are gone.
        while not (store.put(key, blob) and store.lookup([key]) == 1):
            assert time.monotonic() < deadline, "the tier did not recover after the master came back"
            time.sleep(0.2)
        assert bytes(store.get_many([key])[0]) == bytes(memoryview(blob)[len(blob) - 4096:])
        assert stats.take()["offload_mooncake_errors"] >= 1
    finally:
        store.close()


def test_an_instance_starts_while_the_master_is_down_and_joins_once_it_is_up():
    from tests.kv_transfer.offload.mooncake_master import MooncakeMaster

    master = MooncakeMaster(start=False)
    stats = OffloadStats()
    tier = _tier(master.url + "?segment=16MiB&buffer=8MiB", stats)  # no error: the tier waits
    try:
        with pytest.raises(TierError, match="unreachable"):
            tier.contains(["a"])
        master.start()
        tier.put([("a", b"late but there")])
        assert bytes(tier.get(["a"])[0]) == b"late but there"
    finally:
        tier.close()
        master.stop()
