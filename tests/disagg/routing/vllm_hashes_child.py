"""Run with `.venv-vllm`'s interpreter: vLLM's own block hashes for the cases on stdin.

Input (JSON): [{"algo", "block_size", "token_ids", "cache_salt", "pythonhashseed"}, ...]
Output (JSON, last line): per case {"hashes": [hex digest, ...], "ints": [int, ...]}, computed by
vLLM's request block hasher on a real vllm Request (extra keys included), with NONE_HASH
initialized by vLLM for that algorithm under that PYTHONHASHSEED (null: unset), and the integer
form vLLM publishes in its KV events.
"""

import json
import os
import sys

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request


def hashes_of(case: dict) -> dict:
    os.environ.pop("PYTHONHASHSEED", None)
    if case["pythonhashseed"] is not None:
        os.environ["PYTHONHASHSEED"] = case["pythonhashseed"]
    hash_fn = get_hash_fn_by_name(case["algo"])
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(case["block_size"], hash_fn)
    request = Request("r", case["token_ids"], SamplingParams(max_tokens=1), None,
                      cache_salt=case["cache_salt"], block_hasher=hasher)
    return {"hashes": [h.hex() for h in request.block_hashes],
            "ints": [kv_cache_utils.maybe_convert_block_hash(h) for h in request.block_hashes]}


def main() -> None:
    cases = json.load(sys.stdin)
    print(json.dumps([hashes_of(case) for case in cases]))


if __name__ == "__main__":
    main()
