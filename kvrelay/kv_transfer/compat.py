"""The compatibility digest: what two instances must agree on before KV bytes pass between them.

KV written by one instance is only meaningful to another that reads the same bytes the same way:
the same model (weights, not just shapes), the same element format and fp8 scales, the same
layout, block size, head size and KV heads, the same rule mapping heads to TP ranks, and the same
numerics: "default" outside the batch-invariant mode (hosts of any CPU interoperate), and in it
everything that decides the bits (kvrelay/worker/batch_invariance.py), since KV computed under
other numerics would break the mode's bitwise guarantee. These fields, in this order, are
`KVCacheSpec.fingerprint`; its digest is exchanged in the NIXL/TCP handshake and roots every key
of the offload tiers and the Example connector, so an entry written in one format is never found
by a cache of another (an fp32 entry never lands in an fp8 cache).

NOTE: default numerics are left out of the fingerprint (a side that lacks the field has them), so
outside the mode the fingerprint, its digest and so every offload key are what they were before
the field existed: a peer of that version still pairs, and entries stored then are still found.

When two fingerprints differ, `first_difference` names the first field that does and both values,
which is what a refusal says. A pull reader converts between the layouts layouts.py knows (a
vLLM instance and a kvrelay one), so for it a differing layout alone is no refusal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvrelay.kv_transfer.layouts import can_convert

COMPAT_FIELDS = ("model", "kv_cache_dtype", "kv_scales", "layout", "block_size", "head_size",
                 "num_kv_heads", "tp_mapping", "numerics")
DEFAULT_NUMERICS = "default"  # outside the batch-invariant mode; left out of the fingerprint
_WHEN_ABSENT = {"numerics": DEFAULT_NUMERICS}  # what a fingerprint without the field means

# How ranks hold KV heads (docs/disaggregation.md, "Tensor parallelism"): the same rule for every TP size, so
# instances of different TP sizes stay compatible; the sizes themselves are negotiated per transfer
# (a pull, or a push: p2p/tp_plan.py).
TP_MAPPING = "kv-heads-contiguous-split-or-replicated-v1"


def compat_fingerprint(*, model: str, kv_cache_dtype: str, kv_scales: str, layout: str, block_size: int,
                       head_size: int, num_kv_heads: int, tp_mapping: str = TP_MAPPING,
                       numerics: str = DEFAULT_NUMERICS) -> dict[str, Any]:
    """The ordered fingerprint (COMPAT_FIELDS; default numerics left out, see the module note).
    `kv_scales`: the scales policy and a digest of the scales ("none" for formats without);
    `layout`: e.g. "kv[2,Hkv,bs,D]" or MLA's latent tensor; `numerics`: DEFAULT_NUMERICS, or the
    batch-invariant mode's identity."""
    values = (model, kv_cache_dtype, kv_scales, layout, block_size, head_size, num_kv_heads, tp_mapping,
              numerics)
    return {name: value for name, value in zip(COMPAT_FIELDS, values, strict=True)
            if _WHEN_ABSENT.get(name) != value}


def first_difference(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first field (COMPAT_FIELDS order, then any other key sorted) whose values differ, with
    ours and theirs; None when they agree. A field one side lacks counts as differing, but for
    numerics, whose absence means the default."""
    extra = sorted((set(ours) | set(theirs)) - set(COMPAT_FIELDS))
    for name in (*COMPAT_FIELDS, *extra):
        mine, other = (side.get(name, _WHEN_ABSENT.get(name)) for side in (ours, theirs))
        if mine != other:
            return name, mine, other
    return None


def kv_incompatibility(ours: Mapping[str, Any], our_digest: str, our_tp: int,
                       theirs: Mapping[str, Any], their_digest: str, their_tp: int,
                       convert_layouts: bool = False) -> str | None:
    """Why a peer's KV cannot be used here (its first differing field), or None. The digest also
    covers a rank's share of the KV heads, which differs between TP sizes, so it decides only
    between equal sizes; the fingerprint names the model's, and decides between any two.

    `convert_layouts`: the caller rewrites whole blocks it read from the peer's layout into its
    own (layouts.py), so a layout differing in a way that has a conversion is no refusal (the
    digest, which covers the layout, then cannot decide: every other field still must match)."""
    their_layout, our_layout = theirs.get("layout"), ours.get("layout")
    if convert_layouts and their_layout != our_layout:
        if not isinstance(their_layout, str) or not isinstance(our_layout, str) \
                or not can_convert(their_layout, our_layout):
            return (f"layout differs: ours {our_layout!r}, theirs {their_layout!r}, and kvrelay has no "
                    "conversion between them")
        if our_tp != their_tp:
            return (f"layout differs (ours {our_layout!r}, theirs {their_layout!r}) and so does "
                    f"tensor_parallel_size (ours {our_tp}, theirs {their_tp}): kvrelay converts "
                    "whole blocks only, between equal sizes")
        return describe_difference({**ours, "layout": their_layout}, theirs)
    difference = describe_difference(ours, theirs)
    if difference is None and our_tp == their_tp and our_digest != their_digest:
        difference = f"digest differs: ours {our_digest}, theirs {their_digest}"
    return difference


def describe_difference(ours: Mapping[str, Any], theirs: Mapping[str, Any]) -> str | None:
    """"kv_cache_dtype differs: ours 'bfloat16', theirs 'float32'", or None when compatible."""
    found = first_difference(ours, theirs)
    if found is None:
        return None
    name, mine, other = found
    hint = _FIX.get(name)
    return f"{name} differs: ours {mine!r}, theirs {other!r}" + (f" ({hint})" if hint else "")


_FIX = {"numerics": "run both instances with --batch-invariant, or neither; with it, on the same kind of "
                    "CPU or GPU and the same software, which decide the bits"}
