"""Helpers too small for a module of their own, each defined once here (pure Python)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """a / b rounded up, for b > 0: the blocks `a` tokens fill, the chunks `a` bytes take."""
    return -(-a // b)
