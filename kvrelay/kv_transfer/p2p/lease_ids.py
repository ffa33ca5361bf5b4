"""Lease ids: random, and saying when they were issued.

P issues one per request it holds for a decode instance; D names it in every pin, heartbeat and
release. Its issue time lets P tell "not registered yet" from "issued before I started" or "long
gone" without remembering every id it ever issued.
"""

from __future__ import annotations

import secrets


def make_lease_id(issued_ms: int) -> str:
    """A random lease id issued at unix time `issued_ms`."""
    return f"{issued_ms:x}-{secrets.token_hex(12)}"


def lease_issued_ms(lease_id: str) -> int | None:
    """When `lease_id` was issued (unix ms), or None for an id this module did not make."""
    head, _, _ = lease_id.partition("-")
    try:
        return int(head, 16)
    except ValueError:
        return None
