"""NixlPushConnector between tensor-parallel instances, of equal and of different sizes. A D rank
learns P's tp_size from P's base port, registers with every P rank that holds its KV heads (P rank
r listens on kv_port + r) and states the byte ranges of each block it takes; each P rank writes
its readers exactly those ranges (whole blocks between equal sizes), each reader's checksums cover
exactly those bytes, and a request settles only when every rank reported. Answers equal a single
instance's (D computes only each prompt's last token); one P rank's failed write fails the request
once and D recomputes it; P frees every rank's blocks without waiting for a lease; only a size that
cannot hold the model's KV heads is refused, naming both sizes. Every instance ends with no block
in use."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvrelay.disagg.launcher import free_port_run
from kvrelay.engine.llm import LLM
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.kv_transfer.p2p.handshake import HandshakeReply, LocalIdentity
from kvrelay.kv_transfer.push.receiver_state import PushPeer, handshake_problem
from kvrelay.kv_transfer.transport.base import RegionLayout
from tests.kv_transfer.p2p.pd import BLOCK_SIZE, NUM_BLOCKS, PD, greedy, prompt, reference_tokens
from tests.kv_transfer.pull.test_pull_processes import BACKENDS
from tests.kv_transfer.push.push_faults import CORRUPT_MARK, FAILING_MARK, failing_push_config
from tests.kv_transfer.push.test_push_processes import d_params, p_params, push_config
from tests.tiny import tiny_loaded_model

pytestmark = pytest.mark.timeout(300)
MAX_TOKENS = 4
# A short lease: P holds a request a D rank never registers for until it ends.
EXTRA = {"lease_seconds": 1.5, "heartbeat_seconds": 0.5}


def make_engine(config: dict[str, Any] | None, tp: int = 1, kv_heads: int = 2) -> LLMEngine:
    return LLM(loaded_model=tiny_loaded_model(num_key_value_heads=kv_heads), block_size=BLOCK_SIZE,
               num_blocks=NUM_BLOCKS, max_num_batched_tokens=256, tensor_parallel_size=tp,
               kv_transfer_config=config).engine


@pytest.fixture(scope="module")
def reference() -> Iterator[LLMEngine]:
    engine = make_engine(None)
    yield engine
    engine.shutdown()


class Cluster:
    """Prefill and decode instances of tp 1 and 2: with 2 KV heads, P tp 2's rank 1 fails the
    writes of transfers marked FAILING_MARK."""

    def __init__(self, backend: str, kv_heads: int = 2) -> None:
        # NOTE: P tp 2's rank 1 listens on kv_port + 1: both must be free (one free port is not enough)
        p2_config = push_config("kv_producer", backend, port=free_port_run("127.0.0.1", 2), **EXTRA)
        p2_config = failing_push_config(p2_config) if kv_heads == 2 else p2_config
        p1_config = push_config("kv_producer", backend, **EXTRA)
        self.ports = {1: p1_config["kv_port"], 2: p2_config["kv_port"]}
        self.p = {2: make_engine(p2_config, 2, kv_heads), 1: make_engine(p1_config, 1, kv_heads)}
        self.d = {tp: make_engine(push_config("kv_consumer", backend, **EXTRA), tp, kv_heads)
                  for tp in (2, 1)}

    def pair(self, p_tp: int, d_tp: int) -> tuple[PD, int]:
        return PD(self.p[p_tp], self.d[d_tp]), self.ports[p_tp]

    def close(self) -> None:
        for engine in (*self.p.values(), *self.d.values()):
            engine.shutdown()


@pytest.fixture(scope="module", params=BACKENDS[:2])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    built = Cluster(request.param)
    yield built
    built.close()


def push_all(pd: PD, port: int, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    """Both legs of every prompt at once (the proxy's order: D's leg first); D's tokens."""
    for rid, tokens in prompts.items():
        pd.d.add_request({"prompt_token_ids": tokens}, greedy(MAX_TOKENS), request_id=rid,
                         kv_transfer_params=d_params(f"t-{rid}", port))
        pd.p.add_request({"prompt_token_ids": tokens}, greedy(1), request_id=f"p-{rid}",
                         kv_transfer_params=p_params(f"t-{rid}"))
    outs = pd.wait(pd.d, set(prompts), timeout_s=60)
    return {rid: out.outputs[0].token_ids for rid, out in outs.items()}


def settled_without_leaks(pd: PD) -> None:
    pd.settle(timeout_s=30)
    assert pd.p.blocks_in_use == 0 and pd.d.blocks_in_use == 0


def _delta(before: dict[str, Any], after: dict[str, Any], key: str) -> float:
    return float(after[key] - before[key])


def assert_pushed_like_one_instance(pd: PD, port: int, reference: LLMEngine,
                                    prompts: dict[str, list[int]]) -> None:
    """Greedy tokens equal one instance's; D computed only each prompt's last token (every rank's
    heads arrived and verified); nothing failed, every P rank freed once its readers were done,
    and no block is left in use anywhere."""
    d_before, p_before = pd.d.get_stats(), pd.p.get_stats()
    assert push_all(pd, port, prompts) == reference_tokens(reference, prompts, MAX_TOKENS)
    settled_without_leaks(pd)
    d_after, p_after = pd.d.get_stats(), pd.p.get_stats()
    assert _delta(d_before, d_after, "prompt_tokens_computed") == len(prompts)
    assert _delta(d_before, d_after, "kv_load_failures") == 0
    assert _delta(p_before, p_after, "kv_lease_expired") == 0


@pytest.mark.parametrize("p_tp, d_tp", [(2, 2), (1, 2), (2, 1)])
def test_every_tp_pair_pushes_like_one_instance(cluster, reference, p_tp: int, d_tp: int) -> None:
    """tp 2 -> 2 rank to rank in whole blocks; tp 1 -> 2: P's rank writes each D rank its head's
    slice of every block; tp 2 -> 1: D's rank takes each P rank's head into its slice."""
    pd, port = cluster.pair(p_tp, d_tp)
    prompts = {f"ok{p_tp}{d_tp}-{i}": prompt(3 * BLOCK_SIZE + 2 + 5 * i, salt=80 + 7 * p_tp + d_tp + i)
               for i in range(2)}
    assert_pushed_like_one_instance(pd, port, reference, prompts)


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1)])
def test_a_full_local_hit_on_every_d_rank_lets_every_p_rank_free_at_once(cluster, reference, p_tp: int,
                                                                          d_tp: int) -> None:
    """D already holds every full block of the prompt: each D rank tells each P rank it reads from
    that it will not register, and each P rank frees once all its readers said so."""
    pd, port = cluster.pair(p_tp, d_tp)
    tokens = prompt(3 * BLOCK_SIZE + 1, salt=170 + 3 * p_tp + d_tp)
    push_all(pd, port, {f"warm{p_tp}{d_tp}": tokens})
    settled_without_leaks(pd)
    d_before, p_before = pd.d.get_stats(), pd.p.get_stats()
    rid = f"full{p_tp}{d_tp}"
    assert push_all(pd, port, {rid: tokens}) == reference_tokens(reference, {rid: tokens}, MAX_TOKENS)
    settled_without_leaks(pd)
    d_after, p_after = pd.d.get_stats(), pd.p.get_stats()
    assert _delta(d_before, d_after, "prompt_tokens_external") == 0  # nothing pushed
    assert _delta(d_before, d_after, "kv_load_failures") == 0
    assert _delta(p_before, p_after, "kv_lease_expired") == 0


@pytest.mark.parametrize("d_tp", [2, 1])
def test_one_p_ranks_failed_write_fails_the_request_once_and_d_recomputes(cluster, reference,
                                                                         d_tp: int) -> None:
    """P tp 2's rank 1 fails its writes: to D's rank 1 (equal sizes) or to the heads it holds of
    D tp 1's only rank. The failure policy applies once; D keeps no pushed block."""
    pd, port = cluster.pair(2, d_tp)
    rid = f"{FAILING_MARK}-{d_tp}"
    tokens = prompt(4 * BLOCK_SIZE + 1, salt=90 + d_tp)
    before = pd.d.get_stats()
    assert push_all(pd, port, {rid: tokens}) == reference_tokens(reference, {rid: tokens}, MAX_TOKENS)
    after = pd.d.get_stats()
    assert _delta(before, after, "kv_load_failures") == 1
    # the failed receive keeps no pushed block: rank 0's heads arrived, but rank 1's did not
    assert _delta(before, after, "prompt_tokens_computed") == len(tokens)
    settled_without_leaks(pd)


@pytest.mark.parametrize("d_tp", [2, 1])
def test_a_p_ranks_wrong_checksum_is_caught_on_its_own_bytes_and_recomputed(cluster, reference,
                                                                           d_tp: int) -> None:
    """P tp 2's rank 1 states a wrong checksum for the first block it pushed: D's rank that reads
    from it (rank 1; or tp 1's only rank, over the slice of rank 1's head) finds that block bad,
    and D recomputes from it; P rank 0's checksums, over its own bytes, hold."""
    pd, port = cluster.pair(2, d_tp)
    rid = f"{CORRUPT_MARK}-{d_tp}"
    tokens = prompt(4 * BLOCK_SIZE + 1, salt=160 + d_tp)  # no block shared with the other tests
    before = pd.d.get_stats()
    assert push_all(pd, port, {rid: tokens}) == reference_tokens(reference, {rid: tokens}, MAX_TOKENS)
    after = pd.d.get_stats()
    assert _delta(before, after, "kv_load_failures") == 1
    assert _delta(before, after, "prompt_tokens_computed") == len(tokens)  # from the first block on
    settled_without_leaks(pd)


@pytest.fixture(scope="module")
def replicated() -> Iterator[tuple[Cluster, LLMEngine]]:
    """One KV head, so every rank of a tp 2 instance holds all of it (TCP only, like the pull's)."""
    built, reference = Cluster("tcp", kv_heads=1), make_engine(None, kv_heads=1)
    yield built, reference
    built.close()
    reference.shutdown()


@pytest.mark.parametrize("p_tp, d_tp", [(1, 2), (2, 1)])
def test_a_replicated_kv_head_is_pushed_once_to_each_reader_and_every_p_rank_frees(
        replicated, p_tp: int, d_tp: int) -> None:
    """tp 1 -> 2: P's rank writes the whole blocks to both D ranks (two readers); tp 2 -> 1: D's
    rank takes the head from P's rank 0 and tells rank 1, which nobody reads from, to free."""
    cluster, reference = replicated
    pd, port = cluster.pair(p_tp, d_tp)
    prompts = {f"rep{p_tp}{d_tp}-{i}": prompt(9 + 6 * i, salt=120 + 20 * p_tp + 4 * d_tp + i)
               for i in range(2)}
    assert_pushed_like_one_instance(pd, port, reference, prompts)


def test_only_a_size_that_cannot_hold_the_kv_heads_is_refused_naming_both_sizes() -> None:
    """D's rank (tp 1, 2 KV heads of 64 bytes a block) reads P's base-port handshake: tp 1, 2 and 4
    pair with it; tp 3 holds 2 KV heads neither split nor replicated, and is refused naming both."""
    head_bytes = 64
    layout = RegionLayout(("layer.0",), 8, 4 * head_bytes, (0,), "cpu")
    fingerprint = {"model": "m", "num_kv_heads": 2}
    me = LocalIdentity(engine_id="d", backend="tcp", block_size=BLOCK_SIZE, fingerprint_digest="x",
                       fingerprint=fingerprint, layout=layout, tp_rank=0, tp_size=1, num_kv_heads=2)
    peer = PushPeer("127.0.0.1", 14579, 0, thread=None)  # type: ignore[arg-type]

    def reply(p_tp: int) -> HandshakeReply:
        p_heads = 2 // p_tp if p_tp <= 2 else 1
        return HandshakeReply(engine_id="p", instance_id="i", backend="tcp", agent_metadata=b"",
                              layer_names=["layer.0"], num_blocks=8, block_bytes=2 * p_heads * head_bytes,
                              base_addresses=[0], device="cpu", block_size=BLOCK_SIZE,
                              fingerprint_digest="x" if p_tp == 1 else "y", fingerprint=fingerprint,
                              lease_seconds=5.0,
                              tp_size=p_tp, transfer_mode="push")

    for p_tp in (1, 2, 4):
        assert handshake_problem(me, peer, reply(p_tp), p_tp) is None
    problem = handshake_problem(me, peer, reply(3), 3)
    assert problem is not None and "runs tensor_parallel_size 3 and this decode instance 1" in problem
    assert "neither split nor replicated" in problem
