"""Helpers too small for a module of their own, each defined once here (pure Python)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """a / b rounded up, for b > 0: the blocks `a` tokens fill, the chunks `a` bytes take."""
    return -(-a // b)


# How long an idle HTTP keep-alive connection stays open: uvicorn's default and vLLM's
# (VLLM_HTTP_TIMEOUT_KEEP_ALIVE); `kvrelay serve` and `kvrelay proxy` state it, not inherit it.
HTTP_KEEP_ALIVE_S = 5


def busy_port_error(host: str, port: int) -> str | None:
    """Why a server cannot listen on `host:port` now (a message naming the port and the fix), or
    None when it can. Port 0 (any free port) is always fine. The probe sets SO_REUSEADDR, as
    uvicorn does, so a port left in TIME_WAIT by a server that just stopped counts as free."""
    import socket

    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return (f"port {port} on {host} is not free ({e.strerror}); pass another --port "
                    "(0 picks a free one)")
    return None
