"""What the two P2P connectors (pull/ and push/) share: their settings and the transport they
build (settings.py), the handshake and this rank's identity (handshake.py), lease ids
(lease_ids.py), the tensor-parallel read and write plan (tp_plan.py), what D reports after a
step (results.py), and the cluster secret, signed params and block checksums (security.py).

Nothing here imports a connector: pull/ and push/ import these pieces, never each other.
"""

from kvrelay.kv_transfer.p2p.handshake import HandshakeReply, HandshakeRequest, LocalIdentity
from kvrelay.kv_transfer.p2p.settings import BACKENDS, NixlConfig, PushConfig, make_transport

__all__ = ["BACKENDS", "HandshakeReply", "HandshakeRequest", "LocalIdentity", "NixlConfig", "PushConfig",
           "make_transport"]
