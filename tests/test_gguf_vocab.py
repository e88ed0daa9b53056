"""A GGUF file's tokenizer: a handful of tokens and merges written here with gguf's own writer,
and the real SmolLM2 file's tokenizer against transformers' tokenizer.json of it."""

from __future__ import annotations

import json

import gguf
import pytest
from tokenizers import Tokenizer

from batchgen.text.gguf_vocab import GgufTextError, byte_spelling, gguf_text

CONTROL, NORMAL, USER_DEFINED = 3, 1, 4
SPECIALS = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL)]
CHARACTERS = ["h", "e", "l", "o", "Ġ", "w", "r", "d", "Ċ", "1", "2"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d", "Ċ Ċ"]
MERGES += ["1 2", "12 12"]
# merged tokens; "\n\n" is stored as the raw text (some converters do), not as "ĊĊ"
MERGED = ["he", "ll", "hell", "hello", "Ġw", "or", "Ġwor", "Ġworl", "Ġworld", "\n\n", "12", "1212"]
TOKENS = [
    *SPECIALS,
    ("<think>", USER_DEFINED),
    *((token, NORMAL) for token in CHARACTERS + MERGED),
]
IDS = {token: index for index, (token, _) in enumerate(TOKENS)}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"


def vocabulary(**overrides) -> dict:
    """The tiny vocabulary's metadata, with ``overrides`` (None: the key left out)."""
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": [token for token, _ in TOKENS],
        "tokenizer.ggml.token_type": [kind for _, kind in TOKENS],
        "tokenizer.ggml.merges": MERGES,
        "tokenizer.ggml.bos_token_id": IDS["<|im_start|>"],
        "tokenizer.ggml.eos_token_id": IDS["<|im_end|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": TEMPLATE,
    }
    metadata.update(overrides)
    return {key: value for key, value in metadata.items() if value is not None}


def write_vocabulary(path, metadata: dict):
    """A GGUF file of ``metadata`` alone (no tensors); returns ``path``."""
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def text_of(tmp_path, **overrides):
    return gguf_text(write_vocabulary(tmp_path / "vocab.gguf", vocabulary(**overrides)))


def test_byte_spelling_is_gpt2s_alphabet():
    spelling = byte_spelling()
    assert sorted(spelling) == list(range(256)) and len(set(spelling.values())) == 256
    assert (spelling[ord(" ")], spelling[ord("\n")], spelling[ord("a")]) == ("Ġ", "Ċ", "a")
    assert spelling[0] == "Ā" and spelling[0xAD] == "Ń"


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("hello world", ["hello", "Ġworld"]),
        ("hello\n\n", ["hello", "\n\n"]),
        ("<|im_start|>hello<|im_end|>", ["<|im_start|>", "hello", "<|im_end|>"]),
        ("<think>hello world", ["<think>", "hello", "Ġworld"]),
        ("he<|endoftext|>ll", ["he", "<|endoftext|>", "ll"]),
        ("1212", ["1212"]),
        ("", []),
    ],
)
def test_tiny_vocabulary_encodes_to_the_expected_ids_and_decodes_back(tmp_path, text, tokens):
    tokenizer = text_of(tmp_path).tokenizer
    ids = tokenizer.encode(text).ids
    assert ids == [IDS[token] for token in tokens]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_decoding_skips_control_tokens_but_keeps_user_defined_ones(tmp_path):
    tokenizer = text_of(tmp_path).tokenizer
    ids = tokenizer.encode("<|im_start|><think>hello<|im_end|>").ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>hello"


def test_special_tokens_eos_ids_and_template_come_from_the_file(tmp_path):
    text = text_of(tmp_path, **{"tokenizer.ggml.eot_token_id": IDS["<|endoftext|>"]})
    assert (text.bos_token, text.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert text.eos_token_ids == (IDS["<|im_end|>"], IDS["<|endoftext|>"])
    assert text.chat_template == TEMPLATE and text.add_bos is False
    assert text.tokenizer.encode("hello").ids == [IDS["hello"]]


def test_add_bos_token_puts_bos_before_each_text_with_special_tokens(tmp_path):
    text = text_of(tmp_path, **{"tokenizer.ggml.add_bos_token": True})
    assert text.add_bos is True
    assert text.tokenizer.encode("hello").ids == [IDS["<|im_start|>"], IDS["hello"]]
    assert text.tokenizer.encode("hello", add_special_tokens=False).ids == [IDS["hello"]]


def test_a_file_without_template_or_special_ids_has_none(tmp_path):
    text = text_of(
        tmp_path,
        **{
            "tokenizer.chat_template": None,
            "tokenizer.ggml.bos_token_id": None,
            "tokenizer.ggml.eos_token_id": None,
            "tokenizer.ggml.add_bos_token": True,
        },
    )
    assert (text.chat_template, text.bos_token, text.eos_token) == (None, None, None)
    assert text.eos_token_ids == () and text.add_bos is False


@pytest.mark.parametrize(
    ("pre", "tokens"),
    [
        ("smollm", ["1212"]),  # GPT-2's split: a run of digits is one piece
        ("llama-bpe", ["12", "1", "2"]),  # Llama 3: at most three digits a piece
        ("qwen2", ["1", "2", "1", "2"]),  # Qwen2: one digit a piece
    ],
)
def test_the_split_is_the_one_tokenizer_ggml_pre_names(tmp_path, pre, tokens):
    tokenizer = text_of(tmp_path, **{"tokenizer.ggml.pre": pre}).tokenizer
    assert tokenizer.encode("1212").ids == [IDS[token] for token in tokens]


# --- errors ---------------------------------------------------------------------------------------


def vocabulary_error(path) -> str:
    with pytest.raises(GgufTextError) as caught:
        gguf_text(path)
    return str(caught.value)


def test_a_file_without_tokenizer_metadata_names_the_missing_key(tmp_path):
    path = write_vocabulary(tmp_path / "bare.gguf", {"llama.block_count": 2})
    assert vocabulary_error(path) == (
        f"{path}: metadata key 'tokenizer.ggml.model' missing; allowed: a GGUF file that carries"
        " its tokenizer (tokenizer.ggml.model, .tokens, .merges)"
    )


def test_a_sentencepiece_vocabulary_is_refused_naming_the_allowed_model(tmp_path):
    path = write_vocabulary(tmp_path / "v.gguf", vocabulary(**{"tokenizer.ggml.model": "llama"}))
    assert vocabulary_error(path) == (
        f"{path}: tokenizer.ggml.model 'llama' is not supported; allowed: 'gpt2' (byte-level BPE)"
    )


def test_an_unknown_pre_tokenizer_is_refused_with_the_known_ones(tmp_path):
    path = write_vocabulary(tmp_path / "v.gguf", vocabulary(**{"tokenizer.ggml.pre": "falcon"}))
    message = vocabulary_error(path)
    assert message.startswith(f"{path}: tokenizer.ggml.pre 'falcon' is not supported; allowed: ")
    assert "'smollm'" in message and "'qwen2'" in message and "'llama-bpe'" in message


def test_missing_merges_and_bad_ids_are_named(tmp_path):
    path = write_vocabulary(tmp_path / "m.gguf", vocabulary(**{"tokenizer.ggml.merges": None}))
    assert "metadata key 'tokenizer.ggml.merges' missing" in vocabulary_error(path)
    bad_eos = {"tokenizer.ggml.eos_token_id": len(TOKENS)}
    path = write_vocabulary(tmp_path / "e.gguf", vocabulary(**bad_eos))
    assert vocabulary_error(path) == (
        f"{path}: tokenizer.ggml.eos_token_id {len(TOKENS)} is not one of the {len(TOKENS)}"
        " token ids"
    )
    path = write_vocabulary(tmp_path / "b.gguf", vocabulary(**{"tokenizer.ggml.merges": ["hel"]}))
    assert vocabulary_error(path) == (
        f"{path}: tokenizer.ggml.merges holds 'hel'; allowed: two tokens and one space"
    )


def test_a_missing_or_corrupt_file_is_a_gguf_text_error(tmp_path):
    missing = tmp_path / "absent.gguf"
    assert vocabulary_error(missing) == (
        f"{missing}: does not exist; allowed: the path of a GGUF model file"
    )
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 9)
    assert vocabulary_error(corrupt).startswith(f"{corrupt}: not a readable GGUF file (")


# --- the real model -------------------------------------------------------------------------------

REAL_TEXTS = [
    "Hello world",
    " Hello",
    "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n"
    "<|im_start|>user\nHi!<|im_end|>\n",
    "<|im_start|>assistant\n",
    "What is 2+2? It's 4.",
    "12345 678 9",
    "x   5 and a  1 and \n\n42",
    "3.14159e-10, 1,000,000 and $100.00!!!",
    "naïve café, Straße, ﬁ ligature",
    "日本語のテキスト",
    "Привет, мир",
    "مرحبا بالعالم",
    "emoji 😀 👍🏽 👨‍👩‍👧",
    "e\u0301 vs é",
    "",
    " ",
    "   ",
    "\n",
    "\t\ttabs\tand\r\nwindows lines\r\n",
    "  leading and trailing  ",
    "def f(x):\n    return x ** 2  # square\n",
    'for (int i = 0; i < n; ++i) { printf("%d\\n", i); }',
    '{"json": [1, 2, {"a": null}]}',
    "I'm you're THEY'LL we'd",
    "<|endoftext|><|im_end|><repo_name>foo<file_sep>bar",
    "mixed<|im_start|>no-space<|im_end|>after",
    "\u00a0non-breaking\u2009thin space",
    "ĠĊ literal byte-alphabet characters",
    "x" * 64,
    "The quick brown fox jumps over the lazy dog. " * 3,
]


def test_real_model_ids_are_transformers_ids(real_model_gguf, real_model_hf_dir):
    text = gguf_text(real_model_gguf)
    reference = Tokenizer.from_file(str(real_model_hf_dir / "tokenizer.json"))
    assert text.tokenizer.get_vocab_size() == reference.get_vocab_size() == 49152
    for string in REAL_TEXTS:
        ids = text.tokenizer.encode(string).ids
        assert ids == reference.encode(string).ids, string
        assert text.tokenizer.decode(ids) == reference.decode(ids), string


def test_real_model_template_and_special_tokens_are_transformers_ones(
    real_model_gguf, real_model_hf_dir
):
    text = gguf_text(real_model_gguf)
    assert text.chat_template == (real_model_hf_dir / "chat_template.jinja").read_text()
    config = json.loads((real_model_hf_dir / "tokenizer_config.json").read_text())
    assert (text.bos_token, text.eos_token) == (config["bos_token"], config["eos_token"])
    generation = json.loads((real_model_hf_dir / "generation_config.json").read_text())
    assert text.eos_token_ids == (generation["eos_token_id"],) and text.add_bos is False
