"""The offload tiers and the store on their own: LRU by bytes, atomic disk files that survive a
restart, raw Redis values, verified blobs (a mismatch is a miss), promotion, failing tiers."""

from __future__ import annotations

import time

import pytest

from kvrelay.kv_transfer.offload import (
    ChunkError,
    CpuTier,
    DiskTier,
    Expected,
    OffloadConfig,
    OffloadStats,
    TieredStore,
    TierError,
    decode_chunk,
    encode_chunk,
)

FP = "f" * 64
PAYLOAD = 1000


def blob(key: str, fill: int = 7) -> bytearray:
    return encode_chunk(key, FP, memoryview(bytes([fill]) * PAYLOAD))


def key(i: int) -> str:
    return f"{i:040x}"


def test_codec_round_trips_and_rejects_every_mismatch():
    good = blob(key(1))
    assert bytes(decode_chunk(good, key(1), FP, PAYLOAD)) == bytes([7]) * PAYLOAD
    flipped = bytearray(good)
    flipped[-1] ^= 1
    truncated = good[:-10]
    for bad, args, reason in [(flipped, (key(1), FP, PAYLOAD), "checksum"),
                              (good, (key(2), FP, PAYLOAD), "holds chunk"),
                              (good, (key(1), "e" * 64, PAYLOAD), "fingerprint"),
                              (truncated, (key(1), FP, PAYLOAD), "payload bytes"),
                              (good, (key(1), FP, PAYLOAD + 4), "payload bytes"),
                              (b"junk", (key(1), FP, PAYLOAD), "shorter")]:
        with pytest.raises(ChunkError, match=reason):
            decode_chunk(bad, *args)


def test_codec_checks_a_tail_s_token_count_and_reads_chunks_stored_before_tails_existed():
    import struct

    from kvrelay.kv_transfer.offload.codec import header_size, payload_checksum

    payload = memoryview(bytes([3]) * 200)
    tail = encode_chunk(key(1), FP, payload, tail_tokens=5)
    assert bytes(decode_chunk(tail, key(1), FP, 200, tail_tokens=5)) == bytes(payload)
    with pytest.raises(ChunkError, match="holds a tail of 5 tokens, expected a tail of 6 tokens"):
        decode_chunk(tail, key(1), FP, 200, tail_tokens=6)
    with pytest.raises(ChunkError, match="expected a full chunk"):
        decode_chunk(tail, key(1), FP, 200)
    with pytest.raises(ChunkError, match="holds a full chunk"):
        decode_chunk(blob(key(1)), key(1), FP, PAYLOAD, tail_tokens=5)
    # A blob written before tails existed: the same fields, two zero pad bytes where the tail's
    # token count is now. It still reads as a full chunk.
    names = (key(1) + FP).encode()
    start = header_size(key(1), FP)
    old = bytearray(start + PAYLOAD)
    struct.pack_into("<4sHHH2xQQ", old, 0, b"KVRC", 2, 40, len(FP), PAYLOAD,
                     payload_checksum(memoryview(bytes([7]) * PAYLOAD)))
    old[28:28 + len(names)] = names
    old[start:] = bytes([7]) * PAYLOAD
    assert bytes(decode_chunk(old, key(1), FP, PAYLOAD)) == bytes([7]) * PAYLOAD
    assert bytes(old) == bytes(blob(key(1)))


def test_config_rejects_chunks_whose_tail_count_does_not_fit_the_header():
    with pytest.raises(ValueError, match="chunk_tokens must be <= 65536"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1MiB", "chunk_tokens": 65536 + 16}, block_size=16)
    assert OffloadConfig.from_extra_config({"cpu_bytes": "1MiB", "chunk_tokens": 65536},
                                           block_size=16).chunk_tokens == 65536


def test_store_reads_a_tail_as_what_the_reader_expects_and_tiers_count_its_own_size(tmp_path):
    stats = OffloadStats()
    cpu, disk = CpuTier(10 * PAYLOAD, stats), DiskTier(tmp_path, 100 * PAYLOAD, stats)
    store = TieredStore([cpu, disk], FP, PAYLOAD, stats)
    tail = encode_chunk(key(2), FP, memoryview(bytes([9]) * 300), tail_tokens=3)
    assert store.put(key(1), blob(key(1))) and store.put(key(2), tail)
    assert cpu.used_bytes == len(blob(key(1))) + len(tail) and len(tail) < len(blob(key(1)))
    assert (tmp_path / f"{key(2)}.kvc").stat().st_size == len(tail)
    assert store.lookup([key(1), key(2)]) == 2
    full, part = store.get_many([key(1), key(2)], [Expected(PAYLOAD), Expected(300, tail_tokens=3)])
    assert bytes(full or b"") == bytes([7]) * PAYLOAD and bytes(part or b"") == bytes([9]) * 300
    # Read as something else, the tail is corrupt: dropped from every tier that held it.
    assert store.get_many([key(2)], [Expected(300, tail_tokens=4)]) == [None]
    assert cpu.contains([key(2)]) == [False] and not (tmp_path / f"{key(2)}.kvc").exists()
    assert cpu.used_bytes == len(blob(key(1)))
    with pytest.raises(ValueError, match="2 keys but 1 expected"):
        store.get_many([key(1), key(2)], [Expected(PAYLOAD)])


def test_cpu_tier_evicts_the_least_recently_used_past_its_budget():
    stats = OffloadStats()
    size = len(blob(key(0)))
    tier = CpuTier(3 * size, stats)
    tier.put([(key(i), blob(key(i))) for i in range(3)])
    tier.get([key(0)])  # 0 is now the most recent: 1 goes first
    tier.put([(key(3), blob(key(3)))])
    assert tier.contains([key(i) for i in range(4)]) == [True, False, True, True]
    assert tier.keys() == [key(2), key(0), key(3)] and tier.used_bytes == 3 * size
    assert stats.take()["offload_cpu_evictions"] == 1


def test_disk_tier_writes_whole_files_and_a_fresh_instance_indexes_them_in_lru_order(tmp_path):
    size = len(blob(key(0)))
    tier = DiskTier(tmp_path, 3 * size, OffloadStats())
    for i in range(3):
        tier.put([(key(i), blob(key(i)))])
        time.sleep(0.01)  # distinct mtimes
    tier.get([key(0)])  # refreshes 0's mtime: the restart sees it as the most recent
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{key(i)}.kvc" for i in range(3))
    restarted = DiskTier(tmp_path, 3 * size, OffloadStats())
    assert restarted.keys() == [key(1), key(2), key(0)]
    restarted.put([(key(3), blob(key(3)))])
    assert not (tmp_path / f"{key(1)}.kvc").exists()
    assert restarted.get([key(0), key(1)])[0] == blob(key(0))
    assert restarted.get([key(1)]) == [None]


def test_disk_tier_finds_files_another_process_wrote_and_shrinks_to_a_smaller_budget(tmp_path):
    size = len(blob(key(0)))
    writer = DiskTier(tmp_path, 10 * size, OffloadStats())
    reader = DiskTier(tmp_path, 10 * size, OffloadStats())
    writer.put([(key(i), blob(key(i))) for i in range(4)])
    assert reader.contains([key(0), key(3), key(9)]) == [True, True, False]
    smaller = DiskTier(tmp_path, 2 * size, OffloadStats())
    assert len(smaller.keys()) == 2 and len(list(tmp_path.glob("*.kvc"))) == 2


def test_disk_tier_full_disk_is_a_tier_error_and_leaves_no_temp_file(tmp_path, monkeypatch):
    import errno

    from kvrelay.kv_transfer.offload import TierError
    from kvrelay.kv_transfer.offload.tiers import disk as disk_module

    def no_space(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    tier = DiskTier(tmp_path, 10 * PAYLOAD, OffloadStats())
    monkeypatch.setattr(disk_module.os, "replace", no_space)
    with pytest.raises(TierError, match="No space"):
        tier.put([(key(1), blob(key(1)))])
    assert list(tmp_path.iterdir()) == [] and tier.contains([key(1)]) == [False]


def test_store_promotes_a_lower_tier_hit_and_drops_a_corrupt_blob(tmp_path):
    stats = OffloadStats()
    cpu, disk = CpuTier(10 * PAYLOAD, stats), DiskTier(tmp_path, 100 * PAYLOAD, stats)
    store = TieredStore([cpu, disk], FP, PAYLOAD, stats)
    disk.put([(key(1), blob(key(1), fill=1)), (key(2), blob(key(2), fill=2))])
    corrupt = bytearray((tmp_path / f"{key(2)}.kvc").read_bytes())
    corrupt[-3] ^= 0xFF
    (tmp_path / f"{key(2)}.kvc").write_bytes(corrupt)
    assert store.lookup([key(1), key(2), key(3)]) == 2  # contains checks only: corruption unseen
    payloads = store.get_many([key(1), key(2)])
    assert bytes(payloads[0] or b"") == bytes([1]) * PAYLOAD and payloads[1] is None
    assert cpu.contains([key(1), key(2)]) == [True, False], "the disk hit was promoted"
    assert not (tmp_path / f"{key(2)}.kvc").exists(), "a corrupt chunk is removed"
    counts = stats.take()
    assert counts["offload_promotions"] == 1 and counts["offload_disk_corrupt"] == 1
    assert counts["offload_disk_hits"] == 1 and counts["offload_cpu_misses"] == 2


def test_store_keeps_a_private_copy_of_a_buffer_the_writer_reuses(tmp_path):
    # The writer hands over its staging buffer and refills it with the next chunk right after.
    stats = OffloadStats()
    cpu, disk = CpuTier(10 * PAYLOAD, stats), DiskTier(tmp_path, 100 * PAYLOAD, stats)
    store = TieredStore([cpu, disk], FP, PAYLOAD, stats)
    staging = blob(key(1), fill=1)
    assert store.put(key(1), staging, reused=True)
    staging[:] = blob(key(2), fill=2)  # the next chunk lands in the same buffer
    payload = store.get_many([key(1)])[0]
    assert payload is not None and bytes(payload) == bytes([1]) * PAYLOAD
    assert stats.take()["offload_cpu_hits"] == 1, "served by the cpu tier, from its own copy"


def test_redis_tier_stores_raw_values_with_a_ttl(redis_url):
    from kvrelay.kv_transfer.offload.tiers.redis import KEY_PREFIX, RedisTier

    tier = RedisTier(redis_url, OffloadStats(), ttl_seconds=60)
    tier.put([(key(1), blob(key(1)))])
    assert tier.contains([key(1), key(2)]) == [True, False]
    assert tier.get([key(1), key(2)]) == [bytes(blob(key(1))), None]
    raw = tier._client
    assert raw.get(KEY_PREFIX + key(1)) == bytes(blob(key(1)))
    assert 0 < raw.pttl(KEY_PREFIX + key(1)) <= 60_000
    tier.remove([key(1)])
    assert tier.contains([key(1)]) == [False]


def test_a_dead_redis_is_a_miss_and_is_skipped_until_retry_seconds_pass():
    from kvrelay.kv_transfer.offload.tiers.redis import RedisTier

    stats = OffloadStats()
    with socket_closed_port() as port:
        tier = RedisTier(f"redis://127.0.0.1:{port}/0", stats, timeout_seconds=0.2)
        store = TieredStore([tier], FP, PAYLOAD, stats, retry_seconds=60)
        assert store.lookup([key(1)]) == 0
        assert store.get_many([key(1)]) == [None]
        assert store.put(key(1), blob(key(1))) is False
    assert stats.take()["offload_redis_errors"] == 1, "after one failure the tier is skipped"


def test_redis_writes_wait_longer_than_lookups_before_calling_the_server_dead():
    # The writer may be kept off the CPU for a while (it runs on idle time): a SET it could not
    # finish within the short lookup timeout must not mark the tier down. A server that accepts
    # connections and never reads or answers stands in for one that is slow.
    import socket
    import time

    from kvrelay.kv_transfer.offload.tiers.redis import RedisTier

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        url = f"redis://127.0.0.1:{server.getsockname()[1]}/0"
        tier = RedisTier(url, OffloadStats(), timeout_seconds=0.1, write_timeout_seconds=0.8)
        with pytest.raises(TierError, match="EXISTS"):
            tier.contains([key(1)])  # a lookup gives up after the short timeout
        start = time.monotonic()
        with pytest.raises(TierError, match="SET"):
            tier.put([(key(1), bytearray(64 << 20))])  # more than the socket buffers take
        assert time.monotonic() - start >= 0.7, "the write used the longer write timeout"
        tier.close()


class socket_closed_port:  # noqa: N801 - used as a context manager
    """A loopback port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        return None


def test_config_rejects_unknown_keys_no_tier_and_misaligned_chunks():
    with pytest.raises(ValueError, match="unknown"):
        OffloadConfig.from_extra_config({"cpu_byte": 1}, block_size=16)
    with pytest.raises(ValueError, match="at least one tier"):
        OffloadConfig.from_extra_config({}, block_size=16)
    with pytest.raises(ValueError, match="multiple of block_size"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1MiB", "chunk_tokens": 20}, block_size=16)
    assert OffloadConfig.from_extra_config({"cpu_bytes": "1MiB"}, block_size=16).cpu_bytes == 2**20
    with pytest.raises(ValueError, match="remote_write_timeout_seconds"):
        OffloadConfig.from_extra_config({"cpu_bytes": "1MiB", "remote_write_timeout_seconds": 0},
                                        block_size=16)
