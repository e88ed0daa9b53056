"""A checkpoint's sampling defaults, from ``generation_config.json`` as vLLM's
``--generation-config`` reads it:

    auto   the model directory's generation_config.json (a GGUF file carries none)
    vllm   none: OpenAI's defaults only
    DIR    DIR/generation_config.json

Its ``temperature``, ``top_p``, ``top_k`` and ``min_p`` are the defaults of a line (or an
``LLM`` call) that does not set them (a value equal to transformers' own default, such as
``top_k`` 50, is not one: vLLM reads the file through transformers' ``to_diff_dict``); its
``max_new_tokens`` caps every request's ``max_tokens``.
Other fields that change what is sampled (``repetition_penalty`` and the like) cannot be applied:
``ignored`` names those the file sets to anything but transformers' default, for one warning at
start. ``do_sample`` is not read, as vLLM does not read it. EOS ids are the tokenizer's concern
(``TextTokenizer.eos_token_ids``), whatever the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from batchgen.text.tokenizer import read_json_object

FILE = "generation_config.json"
SETTINGS = ("auto", "vllm")  # or a directory
# applied field -> (its range, transformers' default: a value equal to it is dropped, as vLLM
# reads the file through transformers' to_diff_dict)
APPLIED = {
    "temperature": ((0.0, float("inf")), 1.0),
    "top_p": ((0.0, 1.0), 1.0),
    "top_k": ((-1, float("inf")), 50),
    "min_p": ((0.0, 1.0), None),
}
CAP = "max_new_tokens"
# fields that change the sampled tokens, which batchgen does not implement -> transformers' default
NOT_APPLIED = {
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "num_beams": 1,
    "penalty_alpha": None,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "sequence_bias": None,
}


class GenerationConfigError(ValueError):
    """A generation config that cannot be used; the message names the file and what is allowed."""


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults of a checkpoint (empty: OpenAI's own). Immutable."""

    source: Path | None = None  # the file read; None: none was
    sampling: dict = field(default_factory=dict)  # Sampling field -> default, of APPLIED only
    max_new_tokens: int | None = None  # a cap on every request's max_tokens
    ignored: tuple[str, ...] = ()  # fields set in the file that batchgen cannot apply

    def capped(self, max_tokens: int | None) -> int | None:
        """``max_tokens`` under the ``max_new_tokens`` cap (None: no limit, or no cap). Pure."""
        if self.max_new_tokens is None:
            return max_tokens
        return self.max_new_tokens if max_tokens is None else min(max_tokens, self.max_new_tokens)

    def warning(self) -> str | None:
        """The one start-up warning naming the fields not applied, or None. Pure."""
        if not self.ignored:
            return None
        return (
            f"{self.source}: {', '.join(self.ignored)} not applied (batchgen samples with"
            f" {', '.join(APPLIED)} and {CAP})"
        )


def read_generation_defaults(model: str | Path, setting: str = "auto") -> GenerationDefaults:
    """The defaults ``setting`` (``SETTINGS`` or a directory) gives for ``model`` (a directory or
    a GGUF file). GenerationConfigError for a bad setting or file. Reads files only."""
    if setting == "vllm":
        return GenerationDefaults()
    if setting == "auto":
        directory = Path(model)
        if not directory.is_dir():
            return GenerationDefaults()
    else:
        directory = Path(setting)
        if not directory.is_dir():
            raise GenerationConfigError(
                f"--generation-config {setting}: not a directory; allowed: auto, vllm, or a"
                f" directory holding {FILE}"
            )
    path = directory / FILE
    if not path.is_file():
        return GenerationDefaults()
    return _defaults_of(path, read_json_object(path, GenerationConfigError))


def _defaults_of(path: Path, data: dict) -> GenerationDefaults:
    """The defaults ``data`` (read from ``path``) sets, each checked. Pure."""
    sampling = {}
    for name, ((low, high), default) in APPLIED.items():
        value = data.get(name)
        if value is None or value == default:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not low <= value <= high
        ):
            raise GenerationConfigError(f"{path}: {name} {value!r} is outside [{low}, {high}]")
        sampling[name] = max(int(value), 0) if name == "top_k" else float(value)  # -1: all
    cap = data.get(CAP)
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise GenerationConfigError(f"{path}: {CAP} must be a positive integer, not {cap!r}")
    ignored = tuple(
        name for name, default in NOT_APPLIED.items() if data.get(name, default) != default
    )
    return GenerationDefaults(path, sampling, cap, ignored)
