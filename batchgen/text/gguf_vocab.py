"""A GGUF file's own tokenizer: a ``tokenizers.Tokenizer`` built from llama.cpp's
``tokenizer.ggml.*`` metadata, with the file's special tokens and raw chat template.

Byte-level BPE vocabularies (``tokenizer.ggml.model`` 'gpt2': GPT-2, SmolLM, Llama 3, Qwen2) are
built as transformers' GGUF loader builds them, so both give the same ids: every token spelled in
GPT-2's byte alphabet, the file's merges, control tokens as special added tokens and user-defined
ones as plain added tokens (both matched whole), and the text split by the regex
``tokenizer.ggml.pre`` names. For 'smollm' that is GPT-2's own regex, as in transformers; llama.cpp
also splits every digit first, which differs only on a run of whitespace right before a digit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from batchgen.model.gguf_checkpoint import end_of_generation_ids, open_gguf
from batchgen.model.hf_checkpoint import ModelLoadError

BYTE_LEVEL_MODEL = "gpt2"
CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the regex that splits text before BPE; None: GPT-2's (ByteLevel's own)
PRE_TOKENIZER_SPLITS: dict[str, str | None] = {
    "default": None,
    "gpt-2": None,
    "smollm": None,
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}
_REQUIRED = object()


class GgufTextError(ValueError):
    """A GGUF file whose tokenizer cannot be built; the message names the file, the metadata key
    and what is allowed."""


@dataclass(frozen=True)
class GgufText:
    """What a GGUF file says about text: its tokenizer, special tokens and chat template."""

    tokenizer: Tokenizer
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None  # jinja2 source, as the file holds it
    add_bos: bool  # the tokenizer's post-processor adds BOS when encoding with special tokens


def gguf_text(path: str | Path) -> GgufText:
    """The tokenizer, special tokens and chat template of the GGUF file ``path``. GgufTextError
    when the file has no tokenizer metadata or one of a kind not supported."""
    path = Path(path)
    try:
        reader = open_gguf(path)
        eos_ids = tuple(end_of_generation_ids(reader, path))
    except ModelLoadError as error:
        raise GgufTextError(str(error)) from None
    model = _value(reader, "tokenizer.ggml.model", path)
    if model != BYTE_LEVEL_MODEL:
        raise GgufTextError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported; allowed:"
            f" {BYTE_LEVEL_MODEL!r} (byte-level BPE)"
        )
    tokens = _value(reader, "tokenizer.ggml.tokens", path)
    bos, eos = _special(reader, path, tokens, "bos"), _special(reader, path, tokens, "eos")
    add_bos = bool(_value(reader, "tokenizer.ggml.add_bos_token", path, False)) and bos is not None
    add_eos = bool(_value(reader, "tokenizer.ggml.add_eos_token", path, False)) and eos is not None
    tokenizer = _byte_level_tokenizer(reader, path, tokens)
    tokenizer.post_processor = _post_processor(
        tokens, bos if add_bos else None, eos if add_eos else None
    )
    return GgufText(
        tokenizer=tokenizer,
        bos_token=None if bos is None else tokens[bos],
        eos_token=None if eos is None else tokens[eos],
        eos_token_ids=eos_ids,
        chat_template=_value(reader, "tokenizer.chat_template", path, None),
        add_bos=add_bos,
    )


def _value(reader: GGUFReader, key: str, path: Path, default=_REQUIRED):
    """Metadata ``key``'s value; ``default`` when absent, else GgufTextError naming it. Pure."""
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _REQUIRED:
        raise GgufTextError(
            f"{path}: metadata key {key!r} missing; allowed: a GGUF file that carries its"
            " tokenizer (tokenizer.ggml.model, .tokens, .merges)"
        )
    return default


def _special(reader: GGUFReader, path: Path, tokens: list[str], kind: str) -> int | None:
    """The id of the file's ``kind`` ('bos', 'eos') token, None when it names none. Pure."""
    key = f"tokenizer.ggml.{kind}_token_id"
    token_id = _value(reader, key, path, None)
    if token_id is not None and not 0 <= token_id < len(tokens):
        raise GgufTextError(f"{path}: {key} {token_id} is not one of the {len(tokens)} token ids")
    return token_id


def _byte_level_tokenizer(reader: GGUFReader, path: Path, tokens: list[str]) -> Tokenizer:
    """Byte-level BPE over ``tokens`` with the file's merges, added tokens and split. Pure."""
    pre = _value(reader, "tokenizer.ggml.pre", path, "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GgufTextError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not supported; allowed: "
            f"{', '.join(map(repr, PRE_TOKENIZER_SPLITS))}"
        )
    spelling = byte_spelling()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ")) for merge in _value(reader, "tokenizer.ggml.merges", path)]
    malformed = next((" ".join(pair) for pair in merges if len(pair) != 2), None)
    if malformed is not None:
        raise GgufTextError(
            f"{path}: tokenizer.ggml.merges holds {malformed!r}; allowed: two tokens and one space"
        )
    try:
        tokenizer = Tokenizer(models.BPE(vocab, merges, fuse_unk=False))
    except Exception as error:  # tokenizers raises a bare Exception for merges it cannot use
        raise GgufTextError(f"{path}: tokenizer.ggml.merges cannot be used ({error})") from None
    tokenizer.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZER_SPLITS[pre])
    tokenizer.decoder = decoders.ByteLevel()
    _add_tokens(tokenizer, tokens, _value(reader, "tokenizer.ggml.token_type", path, []), vocab)
    return tokenizer


def byte_spelling() -> dict[int, str]:
    """GPT-2's printable character for each byte: printable Latin-1 stands for itself, the other
    bytes take the characters from U+0100 on, in byte order. Pure."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    spelling = {byte: chr(byte) for byte in printable}
    others = [byte for byte in range(256) if byte not in spelling]
    spelling.update({byte: chr(0x100 + index) for index, byte in enumerate(others)})
    return spelling


def _pre_tokenizer(split: str | None) -> pre_tokenizers.PreTokenizer:
    """Bytes spelled in GPT-2's alphabet after splitting by ``split`` (GPT-2's regex when None).
    Pure."""
    if split is None:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _add_tokens(
    tokenizer: Tokenizer, tokens: list[str], token_types: list[int], vocab: dict[str, int]
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens (both
    matched whole, before BPE); a token whose text is not in ``vocab`` (llama.cpp labels some
    wrongly) would get a new id and is left out. Mutates ``tokenizer``."""
    typed = [(token, kind) for token, kind in zip(tokens, token_types) if token in vocab]
    tokenizer.add_special_tokens(
        [AddedToken(token, normalized=False, special=True) for token, k in typed if k == CONTROL]
    )
    tokenizer.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, k in typed
            if k == USER_DEFINED
        ]
    )


def _post_processor(
    tokens: list[str], bos: int | None, eos: int | None
) -> processors.PostProcessor:
    """The template that puts BOS before and EOS after each text (each only where given). Pure."""

    def around(piece: str, type_id: int) -> list[str]:
        first = [] if bos is None else [f"{tokens[bos]}:{type_id}"]
        last = [] if eos is None else [f"{tokens[eos]}:{type_id}"]
        return [*first, f"{piece}:{type_id}", *last]

    return processors.TemplateProcessing(
        single=around("$A", 0),
        pair=around("$A", 0) + around("$B", 1),
        special_tokens=[(tokens[i], i) for i in (bos, eos) if i is not None],
    )
