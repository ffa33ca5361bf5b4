"""The proxy's push mode (NixlPushConnector clusters): both legs start at once.

    client ──> proxy ──1. decode leg (first)──> D   admits, allocates, registers its blocks with P
                     └─2. prefill leg ────────> P   writes each layer into D's blocks as it goes
                     <── D's answer streams back as it arrives; P's single token is discarded

In a pull cluster D cannot start before P answered (P's answer says where the KV is). In a push
cluster D is told where P's side channel is up front, so the proxy needs each prefill
instance's KV address (`host:port`, its kv_ip and kv_port), and both legs share one transfer id:
the proxy's request id.

If the prefill leg fails, D hears no progress from P and prefills locally after its
transfer_timeout_seconds (or fails the request, per its kv_load_failure_policy).
"""

from __future__ import annotations

from typing import Any

TRANSFER_MODES = ("pull", "push")


def parse_kv_address(address: str) -> tuple[str, int]:
    """'host:port' -> (host, port), with a clear error for anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"a prefill KV address must be host:port (its kv_ip and kv_port), got {address!r}")
    return host.strip("[]"), int(port)


def check_push_config(transfer_mode: str, prefill_urls: tuple[str, ...],
                      prefill_kv_addresses: tuple[str, ...]) -> dict[str, tuple[str, int]]:
    """Validate the proxy's mode settings; returns each prefill URL's KV address (push only)."""
    if transfer_mode not in TRANSFER_MODES:
        raise ValueError(f"transfer_mode must be one of {', '.join(TRANSFER_MODES)}, got {transfer_mode!r}")
    if transfer_mode == "pull":
        if prefill_kv_addresses:
            raise ValueError("prefill KV addresses are used only with transfer_mode 'push'")
        return {}
    if len(prefill_kv_addresses) != len(prefill_urls):
        raise ValueError(f"transfer_mode 'push' needs one KV address (host:port) per prefill instance: "
                         f"got {len(prefill_kv_addresses)} for {len(prefill_urls)} prefill URL(s)")
    return {url.rstrip("/"): parse_kv_address(address)
            for url, address in zip(prefill_urls, prefill_kv_addresses, strict=True)}


def push_prefill_params(transfer_id: str) -> dict[str, Any]:
    """P's leg: compute the prompt and push its KV to whoever registers for `transfer_id`."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "transfer_mode": "push",
            "transfer_id": transfer_id, "remote_engine_id": None, "remote_block_ids": None,
            "remote_host": None, "remote_port": None}


def push_decode_params(transfer_id: str, kv_address: tuple[str, int]) -> dict[str, Any]:
    """D's leg: register with the prefill instance at `kv_address` for `transfer_id`."""
    host, port = kv_address
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": "push",
            "remote_request_id": transfer_id, "remote_engine_id": None, "remote_host": host,
            "remote_port": port}
