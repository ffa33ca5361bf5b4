"""Parallel sampling (n > 1): one request fans out into n child requests sharing the prompt's KV.

The prompt is computed once. A block enters the prefix cache only after the step that computed
it, so n children admitted together would each compute the whole prompt. Child 0 is therefore
submitted alone; the other children follow once child 0 has its first output token (its prompt
blocks are published by then) and compute only what the cache cannot give them: the tokens after
the last full block the hit may cover (`get_computed_blocks` stops short of the last token), i.e.
between 1 and block_size tokens each. Without prefix caching every child starts at once.

Seeds follow vLLM: with a request seed s, child i samples with seed s + i (wrapped to 64 bits),
so each child is reproducible and differs from its siblings; without a seed every child draws
from the engine's generator. Only child 0 carries the request's kv_transfer_params (it alone
loads or offers the prompt's KV; its siblings find the blocks in the local cache).

Inside the engine the children are ordinary requests (`<parent id>#<i>`). Each step their outputs
are merged into one RequestOutput under the parent's id holding all n CompletionOutputs (index
i); only the children that moved in that step carry deltas. The merged output is final when every
child has finished.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from kvrelay.outputs import CompletionOutput, RequestOutput
from kvrelay.sampling_params import SEED_MIN, SamplingParams

# submit(prompt, params, request_id, kv_transfer_params): add one n=1 request to the engine.
Submit = Callable[[Any, SamplingParams, str, "dict[str, Any] | None"], Any]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The n=1 params of child `index`: its own seed stream when the request has a seed."""
    seed = params.seed
    if seed is not None:
        seed = (seed + index - SEED_MIN) % 2**64 + SEED_MIN  # stays a signed 64-bit int
    return dataclasses.replace(params, n=1, seed=seed)


@dataclass
class _Parent:
    request_id: str
    prompt: dict[str, Any]  # {"prompt": text | None, "prompt_token_ids": [...]}
    params: SamplingParams
    kv_transfer_params: dict[str, Any] | None
    child_ids: list[str]
    completions: list[CompletionOutput]
    pending: list[int] = field(default_factory=list)  # children not submitted yet
    finished: set[int] = field(default_factory=set)
    kv_transfer_params_out: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    error: str | None = None


class ParallelSampling:
    """The engine's bookkeeping for requests with n > 1."""

    def __init__(self, submit: Submit, is_taken: Callable[[str], bool], stagger: bool) -> None:
        self._submit = submit
        self._is_taken = is_taken
        self._stagger = stagger  # False without prefix caching: nothing to wait for
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, int]] = {}  # child id -> (parent, index)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents or request_id in self._children

    def add(self, request_id: str, prompt: dict[str, Any], params: SamplingParams,
            kv_transfer_params: dict[str, Any] | None) -> None:
        """Register the parent and submit its first child (or all children without caching).
        A ValueError from the submission leaves nothing behind."""
        child_ids = [self._free_child_id(f"{request_id}#{i}") for i in range(params.n)]
        parent = _Parent(request_id, prompt, params, kv_transfer_params, child_ids,
                         [CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)])
        self._submit_child(parent, 0)  # raises before anything is registered
        self._parents[request_id] = parent
        self._children[child_ids[0]] = (parent, 0)
        parent.pending = list(range(1, params.n))
        if not self._stagger:
            self._submit_pending(parent)

    def abort(self, request_ids: Collection[str]) -> list[str]:
        """The engine ids to abort for `request_ids`: a parent's submitted children (the ones not
        submitted yet just end as aborted); other ids are returned as they are."""
        engine_ids: list[str] = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            if parent is None:
                engine_ids.append(rid)
                continue
            self._end_pending(parent, "abort")
            engine_ids.extend(parent.child_ids[i] for i in range(parent.params.n)
                              if i not in parent.finished and parent.child_ids[i] in self._children)
        return engine_ids

    def process(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Replace the children's outputs of one step by one merged output per parent, placed
        where its first child's output was."""
        order: list[RequestOutput | _Parent] = []
        touched: set[str] = set()
        for out in outputs:
            owner = self._children.get(out.request_id)
            if owner is None:
                order.append(out)
                continue
            parent, index = owner
            if parent.request_id not in touched:
                touched.add(parent.request_id)
                order.append(parent)
            self._absorb(parent, index, out)
        return [self._merged_output(e) if isinstance(e, _Parent) else e for e in order]

    # ----------------------------------------------------------------------------- helpers
    def _absorb(self, parent: _Parent, index: int, out: RequestOutput) -> None:
        completion = dataclasses.replace(out.outputs[0], index=index)
        parent.completions[index] = completion
        if index == 0:
            parent.kv_transfer_params_out = out.kv_transfer_params
            parent.num_cached_tokens = out.num_cached_tokens
        if out.error is not None:
            parent.error = out.error
        if out.finished:
            parent.finished.add(index)
            del self._children[out.request_id]
        if index == 0 and parent.pending:
            if completion.token_ids:
                self._submit_pending(parent)  # the prompt's blocks are published now
            elif out.finished:  # child 0 ended before its first token (abort, error)
                self._end_pending(parent, completion.finish_reason or "abort")

    def _merged_output(self, parent: _Parent) -> RequestOutput:
        finished = len(parent.finished) == parent.params.n
        if finished:
            del self._parents[parent.request_id]
        completions = parent.completions
        # The next merged output carries deltas only for the children that move again.
        parent.completions = [dataclasses.replace(c, delta_text="", delta_token_ids=[]) for c in completions]
        return RequestOutput(
            request_id=parent.request_id, prompt=parent.prompt.get("prompt"),
            prompt_token_ids=parent.prompt["prompt_token_ids"], outputs=completions,
            finished=finished, kv_transfer_params=parent.kv_transfer_params_out,
            num_cached_tokens=parent.num_cached_tokens, error=parent.error)

    def _submit_pending(self, parent: _Parent) -> None:
        pending, parent.pending = parent.pending, []
        for index in pending:
            self._submit_child(parent, index)
            self._children[parent.child_ids[index]] = (parent, index)

    def _submit_child(self, parent: _Parent, index: int) -> None:
        kv_params = parent.kv_transfer_params if index == 0 else None
        self._submit(parent.prompt, child_params(parent.params, index), parent.child_ids[index], kv_params)

    def _end_pending(self, parent: _Parent, finish_reason: str) -> None:
        for index in parent.pending:
            parent.completions[index] = CompletionOutput(index=index, text="", token_ids=[],
                                                         finish_reason=finish_reason)
            parent.finished.add(index)
        parent.pending = []

    def _free_child_id(self, candidate: str) -> str:
        # NOTE: a finished child can stay in the scheduler while a connector holds its blocks.
        base, n = candidate, 0
        while self._is_taken(candidate) or candidate in self._children:
            n += 1
            candidate = f"{base}-{n}"
        return candidate
