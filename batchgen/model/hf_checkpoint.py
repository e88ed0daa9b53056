"""An HF-format model directory: its ``config.json`` read into a ``ModelConfig``, and its
safetensors weights (one file, or shards an index lists) checked by their headers, then read one
tensor at a time. Every problem is a ``ModelLoadError`` naming the path, what was wrong and what
is allowed."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError
from safetensors import SafetensorError, safe_open
from torch import Tensor

from batchgen.config import TINY_MODELS, ModelConfig, validation_summary

CONFIG_FILE = "config.json"


INDEX_FILE = "model.safetensors.index.json"


IGNORED_TENSOR_SUFFIX = "rotary_emb.inv_freq"


MAX_NAMES_IN_MESSAGE = 5


class ModelLoadError(ValueError):
    """A model spec that cannot be loaded; the message names the path or name, what was wrong, what
    is allowed."""


def model_directory(spec: str) -> Path:
    path = Path(spec)
    if path.is_dir():
        return path
    if path.exists():
        raise ModelLoadError(
            f"{spec}: is a file; allowed: a model directory ({CONFIG_FILE} and *.safetensors)"
            " or a llama.cpp .gguf file"
        )
    if os.sep in spec or spec.startswith("."):
        raise ModelLoadError(f"{spec}: directory does not exist")
    raise ModelLoadError(
        f"unknown model name {spec!r}; known names: {', '.join(TINY_MODELS)}; "
        f"or pass an HF-format model directory ({CONFIG_FILE} + *.safetensors)"
    )


def read_config(directory: Path) -> ModelConfig:
    path = directory / CONFIG_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"{path}: missing; a model directory needs {CONFIG_FILE} next to its safetensors files"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ModelLoadError(f"{path}: not valid JSON ({error})") from error
    except RecursionError:
        raise ModelLoadError(f"{path}: nests arrays or objects too deeply to parse") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: must hold a JSON object, got {type(raw).__name__}")
    normalised = _normalised_hf_config(raw, path)  # raises ModelLoadError naming the path
    try:
        return ModelConfig.from_hf_dict(normalised)
    except KeyError as error:
        raise ModelLoadError(f"{path}: missing key {error.args[0]!r}") from error
    except ValidationError as error:
        raise ModelLoadError(
            f"{path}: invalid model config: {validation_summary(error, names=ModelConfig.HF_KEYS)}"
        ) from None
    except (ValueError, TypeError) as error:
        raise ModelLoadError(f"{path}: invalid model config: {error}") from error


def _normalised_hf_config(raw: dict, path: Path) -> dict:
    """Reject what the decoder does not implement; lift transformers-5
    ``rope_parameters.rope_theta`` to the top."""
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"{path}: hidden_act {raw['hidden_act']!r} is not supported; allowed: 'silu'"
        )
    if raw.get("use_sliding_window"):
        raise ModelLoadError(
            f"{path}: use_sliding_window is not supported; allowed: full attention on every layer"
        )
    # Mistral has no on/off switch
    if raw.get("model_type") == "mistral" and raw.get("sliding_window") is not None:
        raise ModelLoadError(
            f"{path}: sliding_window {raw['sliding_window']!r} is not supported; allowed: null "
            "(full attention on every layer)"
        )
    rope_key = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    rope = raw.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(
            f"{path}: {rope_key} must be a JSON object or null, got {type(rope).__name__}"
        )
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ModelLoadError(
            f"{path}: rope_type {rope_type!r} is not supported; allowed: 'default' (unscaled RoPE)"
        )
    for key, factor in (
        ("partial_rotary_factor", raw.get("partial_rotary_factor")),
        (f"{rope_key}.partial_rotary_factor", rope.get("partial_rotary_factor")),
    ):
        if factor is not None and not (type(factor) in (int, float) and factor == 1):
            raise ModelLoadError(
                f"{path}: {key} {factor!r} is not supported; allowed: 1 or null (RoPE on every "
                "dimension of a head)"
            )
    if "rope_theta" not in raw and "rope_theta" in rope:
        return {**raw, "rope_theta": rope["rope_theta"]}
    return raw


def checkpoint_weights(
    directory: Path, shapes: dict[str, tuple[int, ...]], config: ModelConfig
) -> Iterator[tuple[str, Tensor]]:
    """Check every tensor's presence and shape first (headers only), then yield the expected tensors
    one at a time."""
    files = _safetensors_files(directory)
    found = _tensor_shapes(files)
    ignored = {name for name in found if name.endswith(IGNORED_TENSOR_SUFFIX)}
    if config.tie_word_embeddings:
        ignored.add("lm_head.weight")
    _check_names_and_shapes(directory, found, ignored, shapes)
    return _read_tensors(files, shapes)


def _safetensors_files(directory: Path) -> list[Path]:
    index_path = directory / INDEX_FILE
    if not index_path.is_file():
        files = sorted(path for path in directory.glob("*.safetensors") if path.is_file())
        if not files:
            raise ModelLoadError(
                f"{directory}: no safetensors files; expected model.safetensors, "
                f"or model-0000x-of-0000y.safetensors shards listed in {INDEX_FILE}"
            )
        return files
    not_an_index = (
        f"{index_path}: not a safetensors index (needs a 'weight_map' object of tensor -> shard"
        " file names)"
    )
    try:
        shard_names = sorted(
            set(json.loads(index_path.read_text(encoding="utf-8"))["weight_map"].values())
        )
    except (
        json.JSONDecodeError,
        UnicodeDecodeError,
        RecursionError,
        KeyError,
        TypeError,
        AttributeError,
    ) as error:
        raise ModelLoadError(not_an_index) from error
    if not all(isinstance(name, str) for name in shard_names):
        raise ModelLoadError(not_an_index)
    missing = [name for name in shard_names if not (directory / name).is_file()]
    if missing:
        raise ModelLoadError(
            f"{index_path}: names {len(missing)} shard(s) missing from {directory}: "
            f"{', '.join(missing[:MAX_NAMES_IN_MESSAGE])}"
        )
    return [directory / name for name in shard_names]


FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # safetensors header names of weights we can convert


def _tensor_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in ``files``, read from the headers only; rejects non-float
    tensors, and a tensor found in two files (which one the model would get is not defined)."""
    shapes, found_in = {}, {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as reader:
                for name in reader.keys():
                    if name in found_in:
                        raise ModelLoadError(
                            f"{file}: tensor {name} is also in {found_in[name].name}; each tensor "
                            "must be in exactly one safetensors file"
                        )
                    found_in[name] = file
                    header = reader.get_slice(name)
                    if header.get_dtype() not in FLOAT_DTYPES:
                        raise ModelLoadError(
                            f"{file}: tensor {name} has dtype {header.get_dtype()}; "
                            f"weights must be one of {', '.join(FLOAT_DTYPES)}"
                        )
                    shapes[name] = tuple(header.get_shape())
        except SafetensorError as error:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({error})") from error
    return shapes


def _check_names_and_shapes(
    directory: Path,
    found: dict[str, tuple[int, ...]],
    ignored: set[str],
    expected: dict[str, tuple[int, ...]],
) -> None:
    missing = [name for name in expected if name not in found]
    if missing:
        raise ModelLoadError(
            f"{directory}: {len(missing)} tensor(s) missing from the checkpoint, e.g. "
            f"{', '.join(missing[:MAX_NAMES_IN_MESSAGE])}"
        )
    unexpected = sorted(name for name in found if name not in expected and name not in ignored)
    if unexpected:
        raise ModelLoadError(
            f"{directory}: {len(unexpected)} tensor(s) the model does not have, e.g. "
            f"{', '.join(unexpected[:MAX_NAMES_IN_MESSAGE])}"
        )
    for name, shape in expected.items():
        if found[name] != shape:
            raise ModelLoadError(
                f"{directory}: tensor {name} has shape {list(found[name])}, expected {list(shape)}"
                f" from {CONFIG_FILE}"
            )


def _read_tensors(
    files: list[Path], expected: dict[str, tuple[int, ...]]
) -> Iterator[tuple[str, Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as reader:
            for name in reader.keys():
                if name in expected:
                    yield name, reader.get_tensor(name)
