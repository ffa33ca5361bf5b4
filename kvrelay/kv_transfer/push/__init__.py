"""NixlPushConnector: the prefill instance writes a prompt's KV into the decode instance's
blocks, layer by layer, while it is still computing the prompt.

    connector.py       the facade: both halves, the protocol, TP pairing
    scheduler.py       the scheduler half: which steps compute a push, what D registers
    worker.py          the worker half: the transport, P's sender and side channel, D's receiver
    sender.py          P: registrations, per-layer writes, checksums (sender_state.py)
    receiver.py        D: registrations, waiting for writes, verification (receiver_state.py)
    messages.py        D: the side-channel calls its peer threads make
    guard.py           D: which blocks a write may land in
    meta.py            the per-step metadata and the push's side-channel messages
"""

from kvrelay.kv_transfer.p2p.settings import PushConfig
from kvrelay.kv_transfer.push.connector import NixlPushConnector

__all__ = ["NixlPushConnector", "PushConfig"]
