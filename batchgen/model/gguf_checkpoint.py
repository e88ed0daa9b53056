"""A llama.cpp GGUF file as a model: its metadata read into a ``ModelConfig``, its tensors renamed
to HF's names, dequantized to float32 and reshaped, one tensor at a time.

llama.cpp's converter permutes the rows of a Llama model's q and k projections (each head's two
RoPE halves interleaved); they are put back in HF's order here. Qwen2 files are not permuted.
Every problem is a ``ModelLoadError`` naming the file, what was wrong and what is allowed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderTensor
from gguf.quants import dequantize
from pydantic import ValidationError

from batchgen.config import ModelConfig, validation_summary
from batchgen.model.hf_checkpoint import MAX_NAMES_IN_MESSAGE, ModelLoadError

GGUF_SUFFIX = ".gguf"
ARCHITECTURES = ("llama", "qwen2")
PERMUTED_ARCHITECTURES = ("llama",)
END_OF_GENERATION_KEYS = tuple(f"tokenizer.ggml.{kind}_token_id" for kind in ("eos", "eot", "eom"))
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_REQUIRED = object()


def is_gguf_file(spec: str) -> bool:
    """Whether ``spec`` names a GGUF file (ends in ``.gguf``, any case). Pure."""
    return spec.lower().endswith(GGUF_SUFFIX)


def open_gguf(path: Path) -> GGUFReader:
    """The parsed header of the GGUF file ``path`` (tensor data stays memory-mapped); the last file
    opened is kept, so reading its config, weights and tokenizer parses it once."""
    if not path.is_file():
        what = "is not a file" if path.exists() else "does not exist"
        raise ModelLoadError(f"{path}: {what}; allowed: the path of a GGUF model file")
    stat = path.stat()
    return _parsed(str(path), stat.st_ino, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _parsed(path: str, inode: int, mtime_ns: int, size: int) -> GGUFReader:
    """``path`` parsed; the other arguments tell a rewritten file from the cached one."""
    try:
        return _PlainReader(path)
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, MemoryError) as error:
        summary = " ".join(str(error).split())[:200]
        raise ModelLoadError(
            f"{path}: not a readable GGUF file ({type(error).__name__}: {summary}); allowed: a"
            " complete GGUF v2 or v3 file as llama.cpp writes it"
        ) from None


class _PlainReader(GGUFReader):
    """gguf's reader over a plain-array view of the mapped file: parsing a vocabulary slices the
    file a few times per token, and a slice of an ``np.memmap`` costs about three of a plain one."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        """Keep ``mapped`` as a plain array (the mapping stays its base); mutates the reader."""
        self._plain = mapped.view(np.ndarray)


def metadata(reader: GGUFReader, key: str, path: Path, default=_REQUIRED):
    """The value of metadata ``key`` (a number, string, bool or list); ``default`` when it is
    absent, or ModelLoadError naming the key when there is none. Pure."""
    field = reader.get_field(key)
    if field is not None:
        return field.contents()
    if default is _REQUIRED:
        raise ModelLoadError(f"{path}: metadata key {key!r} missing; a GGUF model file needs it")
    return default


def end_of_generation_ids(reader: GGUFReader, path: Path) -> list[int]:
    """The ids of the file's end-of-sequence, end-of-turn and end-of-message tokens, in that order,
    without repeats. Pure."""
    ids = [metadata(reader, key, path, None) for key in END_OF_GENERATION_KEYS]
    return list(dict.fromkeys(token_id for token_id in ids if token_id is not None))


# config.json key -> (its GGUF key after "{arch}.", the default where the file has none)
METADATA_KEYS = {
    "num_hidden_layers": ("block_count", _REQUIRED),
    "hidden_size": ("embedding_length", _REQUIRED),
    "intermediate_size": ("feed_forward_length", _REQUIRED),
    "num_attention_heads": ("attention.head_count", _REQUIRED),
    "num_key_value_heads": ("attention.head_count_kv", None),
    "head_dim": ("attention.key_length", None),
    "max_position_embeddings": ("context_length", _REQUIRED),
    "rope_theta": ("rope.freq_base", 10000.0),
    "rms_norm_eps": ("attention.layer_norm_rms_epsilon", _REQUIRED),
    "vocab_size": ("vocab_size", None),
}


def read_gguf_config(path: Path) -> ModelConfig:
    """The ``ModelConfig`` the GGUF file ``path``'s metadata describes, validated as a
    ``config.json`` is (``ModelConfig.from_hf_dict``)."""
    reader = open_gguf(path)
    arch = metadata(reader, "general.architecture", path)
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: general.architecture {arch!r} is not supported; allowed: "
            f"{', '.join(map(repr, ARCHITECTURES))}"
        )
    hf = _hf_config(reader, path, arch)
    try:
        config = ModelConfig.from_hf_dict(hf)
    except ValidationError as error:
        names = {
            field: f"{arch}.{METADATA_KEYS[ModelConfig.HF_KEYS.get(field, field)][0]}"
            for field in ModelConfig.model_fields
            if ModelConfig.HF_KEYS.get(field, field) in METADATA_KEYS
        }
        summary = validation_summary(error, names=names)
        raise ModelLoadError(f"{path}: invalid model metadata: {summary}") from None
    except (ValueError, TypeError) as error:
        raise ModelLoadError(f"{path}: invalid model metadata: {error}") from None
    rope_dims = metadata(reader, f"{arch}.rope.dimension_count", path, config.head_dim)
    if rope_dims != config.head_dim:
        raise ModelLoadError(
            f"{path}: {arch}.rope.dimension_count {rope_dims!r} is not supported; allowed:"
            f" {config.head_dim}, the head dimension (RoPE on every dimension of a head)"
        )
    return config


def _hf_config(reader: GGUFReader, path: Path, arch: str) -> dict:
    """The ``config.json``-shaped dict of the file's metadata. Pure."""
    scaling = metadata(reader, f"{arch}.rope.scaling.type", path, "none")
    if scaling != "none":
        raise ModelLoadError(
            f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported; allowed: 'none'"
            " (unscaled RoPE)"
        )
    hf = {
        hf_key: metadata(reader, f"{arch}.{key}", path, default)
        for hf_key, (key, default) in METADATA_KEYS.items()
    }
    tensor_names = {tensor.name for tensor in reader.tensors}
    return {
        **hf,
        "model_type": arch,
        "vocab_size": hf["vocab_size"] or _token_count(reader, path, arch),
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "eos_token_id": end_of_generation_ids(reader, path),
    }


def _token_count(reader: GGUFReader, path: Path, arch: str) -> int:
    """The length of the file's token list, for a file without ``{arch}.vocab_size``. Pure."""
    field = reader.get_field("tokenizer.ggml.tokens")
    if field is None:
        raise ModelLoadError(
            f"{path}: metadata keys {arch}.vocab_size and tokenizer.ggml.tokens missing; a GGUF"
            " model file needs one of them"
        )
    return len(field.data)


def gguf_weights(
    path: Path, shapes: dict[str, tuple[int, ...]], config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Check every tensor's presence, shape and type first, then yield ``shapes``' tensors as
    float32 one at a time, under HF's names."""
    reader = open_gguf(path)
    tensors = {hf_name(tensor.name): tensor for tensor in reader.tensors}
    ignored = {"lm_head.weight"} if config.tie_word_embeddings else set()
    _check_tensors(path, tensors, ignored, shapes)
    arch = metadata(reader, "general.architecture", path)
    heads = {"self_attn.q_proj": config.num_heads, "self_attn.k_proj": config.num_kv_heads}
    return _read_tensors(tensors, shapes, heads if arch in PERMUTED_ARCHITECTURES else {})


def hf_name(gguf_name: str) -> str:
    """HF's name for llama.cpp's tensor ``gguf_name``; a name without one is returned as is.
    Pure."""
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    match = LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in LAYER_NAMES:
        return gguf_name
    return f"model.layers.{match[1]}.{LAYER_NAMES[match[2]]}.{match[3]}"


def _check_tensors(
    path: Path,
    found: dict[str, ReaderTensor],
    ignored: set[str],
    expected: dict[str, tuple[int, ...]],
) -> None:
    """ModelLoadError for a tensor missing, one the model does not have, a wrong shape or a type
    that cannot be dequantized. Pure."""
    missing = [name for name in expected if name not in found]
    if missing:
        raise ModelLoadError(
            f"{path}: {len(missing)} tensor(s) missing from the file, e.g. "
            f"{', '.join(missing[:MAX_NAMES_IN_MESSAGE])}"
        )
    known = expected.keys() | ignored
    unexpected = [tensor.name for name, tensor in found.items() if name not in known]
    if unexpected:
        raise ModelLoadError(
            f"{path}: {len(unexpected)} tensor(s) the model does not have, e.g. "
            f"{', '.join(unexpected[:MAX_NAMES_IN_MESSAGE])}"
        )
    for name, shape in expected.items():
        tensor = found[name]
        stored = [int(dim) for dim in reversed(tensor.shape.tolist())]  # GGUF: innermost first
        if tuple(stored) != shape:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} ({name}) has shape {stored}, expected {list(shape)}"
                " from the file's metadata"
            )
        if not can_dequantize(tensor.tensor_type):
            allowed = [qtype.name for qtype in GGMLQuantizationType if can_dequantize(qtype)]
            raise ModelLoadError(
                f"{path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which cannot"
                f" be dequantized; allowed: {', '.join(allowed)}"
            )


@functools.cache
def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants.dequantize`` turns ``qtype``'s blocks into float32 (tried on one block
    of zeros). Pure."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    try:
        values = dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return values.dtype == np.float32 and values.size == block_size


def _read_tensors(
    found: dict[str, ReaderTensor],
    expected: dict[str, tuple[int, ...]],
    permuted_heads: dict[str, int],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each expected tensor dequantized, reshaped, and un-permuted where ``permuted_heads`` names
    its module (llama.cpp's converter permuted its rows in groups of that many heads)."""
    for name, shape in expected.items():
        values = dequantize(found[name].data, found[name].tensor_type).reshape(shape)
        for module, num_heads in permuted_heads.items():
            if f".{module}." in name:
                values = unpermute_rows(values, num_heads)
        yield name, torch.from_numpy(np.require(values, np.float32, ("C", "W")))


def unpermute_rows(values: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation: each head's rows, stored as (half, pair) pairs
    interleaved, back to HF's order of first halves then second halves. Pure."""
    rows = values.shape[0]
    grouped = values.reshape(num_heads, rows // num_heads // 2, 2, *values.shape[1:])
    return grouped.swapaxes(1, 2).reshape(values.shape)
