"""A checkpoint's own tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, the chat
template through jinja2, EOS ids from the model's configs. Two sources:

    DIR         tokenizer.json; the chat template from chat_template.jinja, else
                tokenizer_config.json's "chat_template" (the file wins, as in transformers); EOS
                ids: config.json's and generation_config.json's, together (vLLM stops on both)
    FILE.gguf   tokenizer.ggml.* and tokenizer.chat_template of the file's metadata (gguf_vocab)

``tokenizers`` (the Rust library under transformers' fast tokenizers) and jinja2 (the engine HF
chat templates are written for) are all a checkpoint's text needs; transformers' AutoTokenizer
would add a large import for the same two steps. A directory whose tokenizer exists only in a
slow (sentencepiece ``tokenizer.model``) form is refused, naming the file it needs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

TEMPLATE_FILE = "chat_template.jinja"
EOS_CONFIGS = ("config.json", "generation_config.json")


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files that cannot be used; the message names the file and why."""


class TextTokenizer:
    """Encode and decode text, render chat prompts, for one checkpoint (a directory or a GGUF
    file). Immutable after construction."""

    def __init__(self, source: str | Path):
        self.source = Path(source)
        if self.source.suffix.lower() == ".gguf" and self.source.is_file():
            self._read_gguf()
        else:
            self._read_directory()

    def _read_directory(self) -> None:
        """Everything from the checkpoint directory's files. Sets self's fields."""
        tokenizer_file = self.source / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"{tokenizer_file}: missing; generate needs the checkpoint's fast tokenizer"
                " (tokenizer.json)"
            )
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = read_json_object(self.source / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        template_file = self.source / TEMPLATE_FILE
        if template_file.is_file():
            self.template_origin = template_file
            source = template_file.read_text(encoding="utf-8")
        else:
            self.template_origin = self.source / "tokenizer_config.json"
            source = config.get("chat_template")
        self.chat_template = _template(source, self.template_origin)
        self.eos_token_ids = self._eos_ids()

    def _read_gguf(self) -> None:
        """Everything from the GGUF file's tokenizer metadata. Sets self's fields."""
        from batchgen.text.gguf_vocab import GgufTextError, gguf_text

        try:
            text = gguf_text(self.source)
        except GgufTextError as error:
            raise TokenizerError(str(error)) from None
        self.tokenizer = text.tokenizer
        self.bos_token, self.eos_token = text.bos_token, text.eos_token
        self.template_origin = self.source
        self.chat_template = _template(text.chat_template, self.source)
        self.eos_token_ids = text.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's BOS etc. when ``add_special_tokens``)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """``token_ids`` as text, special tokens (BOS, EOS, roles) left out."""
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict]) -> str:
        """The prompt text the chat template makes of ``messages``, ending where the assistant's
        reply starts. TokenizerError when the checkpoint has no template; jinja2 errors (a
        template's ``raise_exception``) come out as ValueError."""
        if self.chat_template is None:
            raise TokenizerError(
                f"{self.template_origin}: no chat template (nor a {TEMPLATE_FILE} beside it);"
                " this checkpoint takes /v1/completions lines only"
            )
        try:
            return self.chat_template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template refused the messages: {error}") from None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of the chat prompt (the template writes its own special tokens)."""
        return self.encode(self.render_chat(messages), add_special_tokens=False)

    def _eos_ids(self) -> tuple[int, ...]:
        """EOS ids: those of ``config.json`` and ``generation_config.json`` together, in that
        order, else the tokenizer's ``eos_token``; () when none names one."""
        ids: dict[int, None] = {}
        for name in EOS_CONFIGS:
            eos = read_json_object(self.source / name).get("eos_token_id")
            ids.update(
                dict.fromkeys(eos if isinstance(eos, list) else [] if eos is None else [eos])
            )
        if ids:
            return tuple(ids)
        token_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        return () if token_id is None else (token_id,)


def read_json_object(path: Path, error: type[ValueError] = TokenizerError) -> dict:
    """The JSON object in a checkpoint's file ``path``; {} when there is no such file. ``error``
    (naming the file) when it is not a JSON object. Reads ``path`` only."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as problem:
        raise error(f"{path}: not JSON ({problem})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: must hold a JSON object, not {type(data).__name__}")
    return data


def _token_text(token) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    return token.get("content") if isinstance(token, dict) else token


def _template(source, origin: Path) -> jinja2.Template | None:
    """The compiled chat template (a string, or the ``default`` of a list of named ones), in HF's
    sandboxed environment settings; None when there is none. ``origin`` is the file it came from,
    for the error."""
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as error:
        raise TokenizerError(f"{origin}: the chat template is not valid jinja2: {error}") from None


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)
