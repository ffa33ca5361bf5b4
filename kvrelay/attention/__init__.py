"""Paged attention: the layer that reads and writes the paged KV cache and calls the connector's
layer hooks (layer.py), the per-step forward context it reads (forward_context.py), and the KV
cache formats it stores (kv_format.py).
"""

from kvrelay.attention.forward_context import ForwardContext, get_forward_context, set_forward_context
from kvrelay.attention.kv_format import KVFormat, kv_format
from kvrelay.attention.layer import Attention, AttentionMetadata, build_attention_metadata

__all__ = ["Attention", "AttentionMetadata", "ForwardContext", "KVFormat", "build_attention_metadata",
           "get_forward_context", "kv_format", "set_forward_context"]
