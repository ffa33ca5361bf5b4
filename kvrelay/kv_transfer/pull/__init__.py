"""NixlConnector: the decode instance pulls a prompt's KV blocks out of the prefill instance.

    connector.py  the facade: both halves, what each extra config key means
    scheduler.py  the scheduler half: signed params on P, what D pulls
    worker.py     the worker half: the transport, P's leases and side channel, D's puller
    leases.py     P: which blocks it holds for whom, until when
    puller.py     D: each pull's life (handshake, pin, read, verify), on the engine thread
    messages.py   D: the side-channel calls its peer threads make
    state.py      D: the bookkeeping of peers and pulls
    meta.py       the per-step metadata and the pull's side-channel messages
"""

from kvrelay.kv_transfer.p2p.settings import NixlConfig
from kvrelay.kv_transfer.pull.connector import NixlConnector

__all__ = ["NixlConfig", "NixlConnector"]
