"""Tokenizer built from GGUF metadata, checked against transformers' reading of the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import tokenizers

from kvrelay.model import gguf_loader
from kvrelay.model.loader import default_model_path
from kvrelay.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld — naïve café, Ünïcödé",
    "日本語のテキストと中文文本",
    "emoji 🤗🚀 and a family 👨‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n\n\nprint(f(3))",
    "tabs\tand\t\tspaces     and\nnewlines\r\n\r\nend   ",
    "numbers 12345 3.14159 -42 1e10 2024-01-01",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text with <|endoftext|> inside and <|im_end|>",
    "I'm sure they've said it's 'quoted' and \"double\"",
    "   leading spaces and trailing   ",
    "",
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? Answer in 日本語 🤗"},
    ],
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    path = default_model_path()
    return gguf_loader.tokenizer_from_gguf(gguf_loader.open_gguf(path), path)


@pytest.fixture(scope="module")
def theirs():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(ours: Tokenizer, theirs, add_special_tokens: bool) -> None:
    for text in TEXTS:
        expected = theirs(text, add_special_tokens=add_special_tokens)["input_ids"]
        assert ours.encode(text, add_special_tokens=add_special_tokens) == expected, text


def test_digits_are_split_before_the_gpt2_regex_as_smollm_requires(ours: Tokenizer, theirs) -> None:
    # llama.cpp's "smollm" pre-tokenizer (like SmolLM2's own tokenizer.json: Digits, then ByteLevel)
    # isolates every digit first, so the spaces before a digit stay one word: "x", "  ", "1".
    # transformers' GGUF reader applies plain GPT-2 splitting here and gets "x", " ", " 1".
    assert [ours.id_to_token(i) for i in ours.encode("x  1")] == ["x", "ĠĠ", "1"]
    assert theirs.convert_ids_to_tokens(theirs("x  1")["input_ids"]) == ["x", "Ġ", "Ġ", "1"]


def test_decode_round_trips(ours: Tokenizer, theirs) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


def test_decode_skips_control_tokens(ours: Tokenizer) -> None:
    ids = ours.encode("<|im_start|>assistant\nHi<|im_end|>")
    assert ids[0] == ours.bos_token_id == 1 and ids[-1] == ours.eos_token_id == 2
    assert ours.decode(ids) == "assistant\nHi"


def test_special_and_stop_ids(ours: Tokenizer) -> None:
    # SmolLM2's GGUF: bos = <|im_start|> (1), eos = <|im_end|> (2), which is also the chat turn end.
    assert ours.id_to_token(1) == "<|im_start|>" and ours.id_to_token(2) == "<|im_end|>"
    assert ours.stop_token_ids == {2}
    assert ours.special_token_ids == set(range(17))  # <|endoftext|> .. <empty_output>
    assert ours.vocab_size == 49152


def test_chat_template_matches_transformers(ours: Tokenizer, theirs) -> None:
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            expected = theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_errors_are_clear(ours: Tokenizer) -> None:
    with pytest.raises(ValueError, match="no 'role'"):
        ours.apply_chat_template([{"content": "hi"}])
    with pytest.raises(ValueError, match="no 'content'"):
        ours.apply_chat_template([{"role": "user"}])
    with pytest.raises(ValueError, match="list of"):
        ours.apply_chat_template("hi")  # type: ignore[arg-type]
    bare = Tokenizer(ours.backend, eos_token_id=2)
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_in_a_template_surfaces_as_value_error(ours: Tokenizer) -> None:
    strict = Tokenizer(
        ours.backend,
        eos_token_id=2,
        chat_template=(
            "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
        ),
    )
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="user first"):
        strict.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_save_and_load_round_trip(ours: Tokenizer, tmp_path: Path) -> None:
    ours.save(tmp_path)
    again = Tokenizer.load(tmp_path)
    assert (again.bos_token_id, again.eos_token_id) == (ours.bos_token_id, ours.eos_token_id)
    assert again.stop_token_ids == ours.stop_token_ids and again.special_token_ids == ours.special_token_ids
    for text in TEXTS:
        assert again.encode(text) == ours.encode(text)
    assert again.apply_chat_template(CONVERSATIONS[2]) == ours.apply_chat_template(CONVERSATIONS[2])


def test_saved_tokenizer_is_readable_by_transformers(ours: Tokenizer, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours.save(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert hf.eos_token == "<|im_end|>"
    assert hf("numbers 12345")["input_ids"] == ours.encode("numbers 12345")
    assert hf.apply_chat_template(CONVERSATIONS[0], tokenize=False) == ours.apply_chat_template(
        CONVERSATIONS[0], add_generation_prompt=False
    )


def test_load_reads_chat_template_jinja_and_added_token_dicts(ours: Tokenizer, tmp_path: Path) -> None:
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": {"content": "<|im_end|>"}}')
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}<|im_end|>")
    loaded = Tokenizer.load(tmp_path, extra_stop_token_ids=[0])
    assert loaded.eos_token_id == 2 and loaded.stop_token_ids == {0, 2}
    assert loaded.apply_chat_template([{"role": "user", "content": "x"}]) == "x<|im_end|>"


def test_load_without_tokenizer_json_names_the_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("pre", ["qwen2", "llama-bpe"])
def test_pre_tokenizer_splits_match_transformers_reference_regex(pre: str) -> None:
    """Our split patterns for Qwen2 / Llama 3 vocabularies agree with transformers' own."""
    gguf_tokenizer = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    reference = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(gguf_tokenizer.GGUF_PRE_TOKENIZER_SPLITS[pre]), behavior="isolated"
    )
    ours = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(p), behavior="isolated")
            for p in gguf_loader._PRE_TOKENIZER_SPLITS[pre]
        ]
    )
    for text in TEXTS:
        assert ours.pre_tokenize_str(text) == reference.pre_tokenize_str(text), text


def test_unknown_tokenizer_model_is_rejected(tmp_path: Path) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf_loader.open_gguf(tmp_path / "spm.gguf")
    with pytest.raises(ValueError, match=r"spm\.gguf: tokenizer model 'llama' is not supported"):
        gguf_loader.tokenizer_from_gguf(reader, tmp_path / "spm.gguf")
