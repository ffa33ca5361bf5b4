"""NixlPushConnector over the cuda_ipc transport: P opens the handles D registered with it and
copies each layer into D's blocks. On the HostIpc seam (shared host memory) so it runs without a
GPU; the pair must end with no block in use and no thread left (make_pair)."""

from __future__ import annotations

import pytest

from kvrelay.kv_transfer.transport import cuda_ipc, ipc
from kvrelay.kv_transfer.transport.ipc import HostIpc
from tests.kv_transfer.p2p.pd import BLOCK_SIZE, prompt
from tests.kv_transfer.push import test_push_inprocess as inprocess
from tests.kv_transfer.push.test_push_inprocess import NUM_LAYERS, Spy, push, ref_tokens

# The in-process push tests' fixtures, used here as they are.
spy, make_pair, reference = inprocess.spy, inprocess.make_pair, inprocess.reference


@pytest.fixture(autouse=True)
def host_ipc(monkeypatch: pytest.MonkeyPatch, spy: Spy) -> None:
    """cuda_ipc's CUDA seam replaced by HostIpc, and the GPU check by nothing."""
    monkeypatch.setattr(ipc, "check_cuda_ipc_possible", lambda: None)
    monkeypatch.setattr(cuda_ipc, "CudaIpc", lambda device: HostIpc())
    spy.backend = "cuda_ipc"


def test_push_over_cuda_ipc_writes_each_layer_and_reproduces_the_tokens(make_pair, spy, reference) -> None:
    pair, port = make_pair()
    tokens = prompt(3 * BLOCK_SIZE + 1, 70)
    out = push(pair, port, "a", tokens)
    assert out.outputs[0].token_ids == ref_tokens(reference, tokens, 4)
    writes = [w for w in spy.writes if w.num_blocks]
    assert [w.layers for w in writes] == [(layer,) for layer in range(NUM_LAYERS)]
    assert [w.notified for w in writes] == [False] * (NUM_LAYERS - 1) + [True]
