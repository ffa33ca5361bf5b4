"""Triton kernels for the CUDA attention route, over kvrelay's one paged KV layout.

Per layer the cache is `kv_cache[num_blocks, 2, H_kv, block_size, head_dim]` (K at 0, V at 1,
contiguous), fp8 formats with `kv_scales[2, H_kv]` float32 (see layout.py). A step runs:
- `store_kv`: this step's K/V into the cache at their slots (slot -1: padding, skipped);
- `paged_decode`: the sequences with one query token, reading their blocks in place;
- `paged_prefill`: the sequences with several query tokens over their cached context.

Every launcher validates its tensors (ValueError naming the offending value) and does no device
sync, so the decode path can be captured in a CUDA graph. Without a GPU the kernels run under
`TRITON_INTERPRET=1` (set before triton is imported), which is how tests/kernels/triton runs them.
"""

from kvrelay.kernels.triton.decode import decode_num_splits, paged_decode
from kvrelay.kernels.triton.prefill import paged_prefill
from kvrelay.kernels.triton.store_kv import store_kv

__all__ = ["decode_num_splits", "paged_decode", "paged_prefill", "store_kv"]
