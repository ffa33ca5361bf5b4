"""The built-in TCP transport: pull and push over plain sockets, for machines without NIXL.

    wire.py       the wire format and the socket helpers both ends use
    server.py     the data port: serves READs of this side's blocks, takes WRITs into them
    transport.py  TcpTransport: reads and writes a peer's blocks
"""

from kvrelay.kv_transfer.transport.tcp.transport import TcpTransport

__all__ = ["TcpTransport"]
