"""Where the proxy sends each leg: routing policies over a KV index fed by the instances' events.

    prompt.py    PromptBlocks: a request's token ids and block hashes, as the engine computes them
    kv_index.py  KVIndex: per instance, the blocks it holds by medium (an EventSink)
    policies.py  round-robin, least-loaded, kv-aware, each decision with a reason
"""

from kvrelay.disagg.routing.kv_index import IndexStatus, KVIndex
from kvrelay.disagg.routing.policies import POLICIES, Decision, RoutingPolicy, create_policy
from kvrelay.disagg.routing.prompt import PromptBlocks, PromptReader

__all__ = ["POLICIES", "Decision", "IndexStatus", "KVIndex", "PromptBlocks", "PromptReader",
           "RoutingPolicy", "create_policy"]
