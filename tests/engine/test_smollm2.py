"""The default model end to end: SmolLM2-135M-Instruct from its GGUF gives transformers' greedy
tokens (transformers reading the same GGUF itself) for a fixed set of chat prompts."""

from __future__ import annotations

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.model.loader import default_model_path

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about caching."}],
    [{"role": "system", "content": "You answer in one short sentence."},
     {"role": "user", "content": "Why is the sky blue?"}],
    [{"role": "user", "content": "List three prime numbers."},
     {"role": "assistant", "content": "2, 3 and 5."},
     {"role": "user", "content": "Now three more, please."}],
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf_smollm2():
    """transformers' own model and tokenizer for the GGUF (no kvrelay code involved)."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = default_model_path()
    config = transformers.AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # buffers off the meta device
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.float().eval(), tokenizer


@pytest.fixture(scope="module")
def llm():
    return LLM(kv_cache_memory="64MiB", max_num_seqs=8)


def test_chat_prompts_tokenize_identically(llm, hf_smollm2):
    _, hf_tok = hf_smollm2
    for chat in CHATS:
        text = llm.tokenizer.apply_chat_template(chat)
        assert text == hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert llm.tokenizer.encode(text) == hf_tok.encode(text, add_special_tokens=True)


def test_greedy_chat_matches_transformers_token_for_token(llm, hf_smollm2):
    model, _ = hf_smollm2
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat(CHATS, params, use_tqdm=False)  # one batch: also exercises batching
    for out in outs:
        prompt = out.prompt_token_ids
        with torch.inference_mode():
            ref = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=2, pad_token_id=2)[0, len(prompt):].tolist()
        got = out.outputs[0].token_ids
        assert got == ref[:len(got)]
        assert len(got) == len(ref) or got[-1] == 2  # stopped at <|im_end|> exactly where transformers did
    assert "Paris" in outs[0].outputs[0].text
    assert llm.engine.blocks_in_use == 0
