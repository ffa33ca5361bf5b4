"""What the proxy learns of an instance when it joins, from its GET /v1/models: its context
length (vLLM's `max_model_len`) and, for a kvrelay instance, the connector that moves its KV
(`kv_transfer`: its `transfer_mode`, "pull" or "push").

A proxy whose transfer mode differs from an instance's would make every request wait for KV
that never comes (D gives up after its transfer timeout and recomputes), so such an instance
is refused, naming both modes and the flag to pass. A vLLM instance says nothing about its
connector: nothing is refused then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx


class TransferModeError(ValueError):
    """An instance runs another transfer mode than the proxy."""


@dataclass(frozen=True)
class ModelCard:
    max_model_len: int | None = None  # None: the instance does not say
    kv_connector: str | None = None  # None: no connector, or an instance that does not say (vLLM)
    transfer_mode: str | None = None  # "pull" | "push"; None: it moves no KV, or does not say


async def fetch_instance_info(client: httpx.AsyncClient, url: str, headers: dict[str, str],
                              timeout: float) -> ModelCard | None:
    """What the instance's GET /v1/models says (nothing, from an answer without a model card);
    None when it does not answer (yet)."""
    try:
        response = await client.get(url + "/v1/models", headers=headers, timeout=timeout)
    except httpx.HTTPError:
        return None
    try:
        answer = response.json() if response.status_code == 200 else None
    except ValueError:
        answer = None
    cards = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(cards, list) or not cards or not isinstance(cards[0], dict):
        return ModelCard()
    card: dict[str, Any] = cards[0]
    kv_transfer = card.get("kv_transfer")
    if not isinstance(kv_transfer, dict):
        kv_transfer = {}
    return ModelCard(max_model_len=_int_or_none(card.get("max_model_len")),
                        kv_connector=_str_or_none(kv_transfer.get("kv_connector")),
                        transfer_mode=_str_or_none(kv_transfer.get("transfer_mode")))


def mismatch(role: str, url: str, info: ModelCard, proxy_mode: str) -> str | None:
    """"the <role> instance <url> runs <connector> (transfer mode <mode>)" when that mode is not
    the proxy's; None when it is, or when the instance does not say."""
    if info.transfer_mode is None or info.transfer_mode == proxy_mode:
        return None
    return f"the {role} instance {url} runs {info.kv_connector} (transfer mode {info.transfer_mode})"


def refusal(mismatches: list[str], proxy_mode: str, joining: bool = False) -> str:
    """Why the proxy refuses the instances `mismatch` described, and the fix. `joining`: they are
    being added to a running proxy (the fix is then another proxy, or other instances)."""
    if proxy_mode == "pull":
        flags = "--transfer-mode push --prefill-kv HOST:PORT (each prefill instance's kv_ip:kv_port)"
    else:
        flags = "--transfer-mode pull (the default), without --prefill-kv"
    fix = f"add it to a proxy started with {flags}" if joining else f"start the proxy with {flags}"
    return (f"{' and '.join(mismatches)}, but this proxy runs transfer mode {proxy_mode}: every request "
            f"would wait for KV that never comes; {fix}")


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None
