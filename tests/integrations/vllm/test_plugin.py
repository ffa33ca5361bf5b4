"""The plugin as vLLM meets it, checked in `.venv-vllm` (built when missing): a cheap import, the
`vllm.general_plugins` entry point, the version check, and the KV layout as vLLM's own CPU kernel
writes it, converted by kvrelay."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from tests.vllm_serve import ROOT, vllm_env, vllm_python

_CHECKS = r"""
import json, sys
result = {}
import kvrelay.integrations.vllm as plugin
result["imports_vllm_or_torch"] = sorted(m for m in ("vllm", "torch") if m in sys.modules)
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.utils.func_utils import supports_kw
result["registered"] = [n for n in plugin.CONNECTOR_NAMES if issubclass(
    KVConnectorFactory.get_connector_class_by_name(n), KVConnectorBase_V1)]
result["three_arguments"] = all(supports_kw(getattr(plugin, n), "kv_cache_config")
                                for n in plugin.CONNECTOR_NAMES)
import vllm
from kvrelay.integrations.vllm.version import check_vllm_version
check_vllm_version()
real_version, vllm.__version__ = vllm.__version__, "0.33.0+cpu"
try:
    check_vllm_version()
    result["other_version"] = "accepted"
except RuntimeError as e:
    result["other_version"] = str(e)
vllm.__version__ = real_version
from types import SimpleNamespace
from kvrelay.integrations.vllm.connectors import kvrelay_setup
from kvrelay.integrations.vllm.kv_layout import UnsupportedVllmCache
try:
    parallel = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=1)
    kvrelay_setup(SimpleNamespace(parallel_config=parallel), None, "NixlConnector")
    result["tensor_parallel"] = "accepted"
except UnsupportedVllmCache as e:
    result["tensor_parallel"] = str(e)
"""

_LAYOUT = r"""
import torch
from vllm._custom_ops import cpu_attn_reshape_and_cache
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from kvrelay.integrations.vllm.kv_layout import VllmCacheShape, kvrelay_views
from kvrelay.kv_transfer.layouts import KVRELAY_LAYOUT, convert_blocks, vllm_cpu_layout
results = {}
for dtype in (torch.float32, torch.bfloat16):
    num_blocks, heads, block_size, head_size = 4, 3, 32, 64
    isa = _get_attn_isa(dtype, block_size, head_size)
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=dtype)  # as vLLM registers it
    k_cache, v_cache = cache.view(num_blocks, heads, 2 * block_size, head_size).chunk(2, dim=2)
    key = torch.randn(2 * block_size, heads, head_size).to(dtype)  # tokens of blocks 1 and 2
    value = torch.randn(2 * block_size, heads, head_size).to(dtype)
    slots = torch.arange(block_size, 3 * block_size)
    cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0,
                               kv_cache_dtype="auto")
    shape = VllmCacheShape(("layer",), block_size, heads, head_size, str(dtype).split(".")[1],
                           vllm_cpu_layout(isa))
    layer = kvrelay_views({"layer": cache}, shape)["layer"]
    convert_blocks([layer], [1, 2], shape.layout, KVRELAY_LAYOUT)
    want = torch.stack((key.view(2, block_size, heads, head_size).transpose(1, 2),
                        value.view(2, block_size, heads, head_size).transpose(1, 2)), dim=1)
    results[str(dtype)] = [isa, shape.layout, torch.equal(layer[1:3], want)]
result["layouts"] = results
print(json.dumps(result))
"""


@pytest.fixture(scope="module")
def checked() -> dict[str, Any]:
    """Both scripts, in one `.venv-vllm` process (vLLM takes seconds to import)."""
    result = subprocess.run([str(vllm_python()), "-c", _CHECKS + _LAYOUT], cwd=ROOT, env=vllm_env(None),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return dict(json.loads(result.stdout.strip().splitlines()[-1]))


def test_the_plugin_imports_cheaply_registers_kvrelays_names_and_refuses_another_vllm(
        checked: dict[str, Any]) -> None:
    result = checked
    assert result["imports_vllm_or_torch"] == []
    assert result["registered"] == ["KvrelayConnector", "KvrelayOffloadConnector", "KvrelayPushConnector"]
    assert result["three_arguments"] is True
    assert "support vLLM 0.32.0" in str(result["other_version"]) and "0.33.0" in str(result["other_version"])
    assert "tensor_parallel_size 1" in str(result["tensor_parallel"])  # refused at start, naming why


def test_vllms_cpu_kernel_writes_the_layout_kvrelay_converts_from(checked: dict[str, Any]) -> None:
    """Known K/V written through vLLM's own cpu_attn_reshape_and_cache come out of kvrelay's
    conversion as kvrelay's [2, H, bs, D] blocks, bit for bit (float32 and bfloat16)."""
    assert len(checked["layouts"]) == 2
    for isa, layout, equal in checked["layouts"].values():
        assert layout == "vllm-cpu[Hkv,Kt(D,bs)|V(bs,D)]", f"ISA {isa}: a layout kvrelay does not convert"
        assert equal is True
