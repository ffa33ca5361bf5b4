"""The compatibility fingerprint: field order and the first difference a refusal names."""

from __future__ import annotations

from kvrelay.kv_transfer.compat import (
    COMPAT_FIELDS,
    DEFAULT_NUMERICS,
    compat_fingerprint,
    describe_difference,
    first_difference,
    kv_incompatibility,
)


def fingerprint(**changes: object) -> dict[str, object]:
    base = dict(model="llama/L2/w0", kv_cache_dtype="float32", kv_scales="none", layout="kv[2,Hkv,bs,D]",
                block_size=16, head_size=64, num_kv_heads=3)
    return compat_fingerprint(**{**base, **changes})  # type: ignore[arg-type]


def test_fields_come_in_the_documented_order() -> None:
    assert tuple(fingerprint(numerics="batch-invariant-v1; ...")) == COMPAT_FIELDS


def test_default_numerics_leave_the_fingerprint_as_it_was_before_the_field() -> None:
    """So a peer of that version still pairs, and offload entries it stored are still found."""
    before = ("model", "kv_cache_dtype", "kv_scales", "layout", "block_size", "head_size", "num_kv_heads",
              "tp_mapping")
    assert tuple(fingerprint()) == before == tuple(fingerprint(numerics=DEFAULT_NUMERICS))
    mode = fingerprint(numerics="batch-invariant-v1; tp1")
    assert first_difference(fingerprint(), mode) == ("numerics", "default", "batch-invariant-v1; tp1")
    assert describe_difference(mode, fingerprint()).startswith(  # type: ignore[union-attr]
        "numerics differs: ours 'batch-invariant-v1; tp1', theirs 'default' (run both instances with "
        "--batch-invariant, or neither")


def test_the_first_differing_field_is_named_with_both_values() -> None:
    ours, theirs = fingerprint(kv_cache_dtype="bfloat16", block_size=32), fingerprint()
    assert first_difference(ours, theirs) == ("kv_cache_dtype", "bfloat16", "float32")
    assert describe_difference(ours, theirs) == "kv_cache_dtype differs: ours 'bfloat16', theirs 'float32'"
    assert describe_difference(fingerprint(), fingerprint()) is None


def test_a_field_only_one_side_has_differs() -> None:
    theirs = {k: v for k, v in fingerprint().items() if k != "tp_mapping"}
    assert first_difference(fingerprint(), theirs) == ("tp_mapping", fingerprint()["tp_mapping"], None)
    assert first_difference({**fingerprint(), "extra": 1}, fingerprint()) == ("extra", 1, None)


def test_the_digest_decides_only_between_equal_tp_sizes() -> None:
    """A rank's digest covers its share of the heads, so it differs between TP sizes by design;
    the fingerprint (the model's) decides between any two."""
    same = fingerprint()
    assert kv_incompatibility(same, "d1", 2, same, "d1", 2) is None
    assert kv_incompatibility(same, "d1", 2, same, "d2", 2) == "digest differs: ours d1, theirs d2"
    assert kv_incompatibility(same, "d1", 1, same, "d2", 2) is None
    assert kv_incompatibility(fingerprint(kv_cache_dtype="bfloat16"), "d1", 1, same, "d2", 2) == \
        "kv_cache_dtype differs: ours 'bfloat16', theirs 'float32'"
