"""A checkpoint directory's own tokenizer: ``tokenizer.json`` through the ``tokenizers`` library,
the chat template of ``tokenizer_config.json`` through jinja2, EOS from ``generation_config.json``.

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


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files that cannot be used; the message names the file and why."""


class TextTokenizer:
    """Encode and decode text, render chat prompts, for one checkpoint directory. Immutable after
    construction."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        tokenizer_file = self.directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerError(
                f"{tokenizer_file}: missing; generate needs the checkpoint's fast tokenizer"
                " (tokenizer.json)"
            )
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(self.directory / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.chat_template = _template(config.get("chat_template"), tokenizer_file.parent)
        self.eos_token_ids = self._eos_ids(config)

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
                f"{self.directory / 'tokenizer_config.json'}: no chat_template; this checkpoint"
                " takes /v1/completions lines only"
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

    def _eos_ids(self, config: dict) -> tuple[int, ...]:
        """EOS ids: ``generation_config.json``'s, else ``config.json``'s, else the tokenizer's
        ``eos_token``; () when none names one."""
        for name in ("generation_config.json", "config.json"):
            eos = _read_json(self.directory / name).get("eos_token_id")
            if eos is not None:
                return tuple(eos) if isinstance(eos, list) else (eos,)
        token_id = self.tokenizer.token_to_id(self.eos_token) if self.eos_token else None
        return () if token_id is None else (token_id,)


def _read_json(path: Path) -> dict:
    """The JSON object in ``path``; {} when there is no such file. TokenizerError when it is not a
    JSON object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise TokenizerError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: must hold a JSON object, not {type(data).__name__}")
    return data


def _token_text(token) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    return token.get("content") if isinstance(token, dict) else token


def _template(source, directory: Path) -> jinja2.Template | None:
    """The compiled chat template (a string, or the ``default`` of a list of named ones), in HF's
    sandboxed environment settings; None when there is none."""
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
        raise TokenizerError(
            f"{directory / 'tokenizer_config.json'}: chat_template is not valid jinja2: {error}"
        ) from None


def _raise_exception(message: str):
    raise jinja2.TemplateError(message)
