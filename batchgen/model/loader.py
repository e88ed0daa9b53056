"""Build a ``LlamaForCausalLM`` from a ``TINY_MODELS`` name (seeded init), an HF-format directory or
a GGUF file.

The model is first built on the meta device; each weight is then produced one at
a time (drawn or read on CPU), converted to the requested dtype, moved to the
device and assigned, so peak host memory is one tensor, not the whole model. An HF directory's
config and tensors are read by ``hf_checkpoint``, a GGUF file's by ``gguf_checkpoint``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from batchgen.config import DTYPE_SIZES, TINY_MODELS, ModelConfig
from batchgen.model.gguf_checkpoint import gguf_weights, is_gguf_file, read_gguf_config
from batchgen.model.hf_checkpoint import (
    ModelLoadError,
    checkpoint_weights,
    model_directory,
    read_config,
)
from batchgen.model.llama import LlamaForCausalLM
from batchgen.model.onednn_linear import can_pack, pack_linears
from batchgen.model.stacked import hf_tensors, stacked_location

# config's dtype names are torch's
SUPPORTED_DTYPES = {name: getattr(torch, name) for name in DTYPE_SIZES}
INIT_STD = 0.02


def load_model(
    spec: str,
    *,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
    seed: int = 0,
    max_model_len: int | None = None,
) -> LlamaForCausalLM:
    """Load ``spec``: a ``TINY_MODELS`` name (weights drawn from ``seed``), an HF-format model
    directory or a GGUF file (``*.gguf``, dequantized); its context cut to ``max_model_len``
    tokens when given.

    A directory holds ``config.json`` and either ``model.safetensors`` or shards listed
    in ``model.safetensors.index.json``. Raises ``ModelLoadError`` for anything it cannot load.
    """
    torch_dtype = _parse_dtype(dtype)
    model, shapes, weights = _model_and_weights(spec, seed, max_model_len)
    num_bytes = sum(math.prod(shape) for shape in shapes.values()) * DTYPE_SIZES[dtype]
    _check_memory(spec, num_bytes, dtype, torch.device(device))
    try:
        for name, tensor in weights:
            _assign_parameter(model, name, tensor.to(device=device, dtype=torch_dtype))
    except torch.OutOfMemoryError as error:
        raise ModelLoadError(
            _no_memory(
                spec,
                num_bytes,
                dtype,
                f"the {torch.device(device).type} allocator refused ({error})",
            )
        ) from None
    except RuntimeError as error:
        # the CPU allocator's words for it (a ulimit, say)
        if "can't allocate memory" not in str(error):
            raise
        raise ModelLoadError(
            _no_memory(spec, num_bytes, dtype, "the CPU allocator refused")
        ) from None
    model.tie_weights()
    if can_pack(torch.device(device), torch_dtype):
        # a tied lm_head too, as a packed copy beside the embedding (SmolLM2-135M: 113 MB in
        # float32): left dense, MKL re-packed it on every call (docs/benchmarks-engine.md)
        pack_linears(model)
    return model.to(device).requires_grad_(False).eval()


def _check_memory(spec: str, num_bytes: int, dtype: str, device: torch.device) -> None:
    """ModelLoadError when ``device`` has less memory available than the weights take (the OS would
    kill the process, without a word, part way through). Linux's MemAvailable on the CPU, the free
    memory on a GPU; no check where neither is known."""
    available = device_memory_available(device)
    if available is not None and num_bytes > available:
        raise ModelLoadError(
            _no_memory(
                spec, num_bytes, dtype, f"{available / 2**30:.1f} GiB is available on {device.type}"
            )
        )


def device_memory_available(device: torch.device) -> int | None:
    """Bytes ``device`` has available: Linux's MemAvailable for the CPU; for a GPU its free memory
    plus what torch's caching allocator holds unused (a previous worker's freed pools, which the
    next allocation reuses); None where neither is known."""
    if device.type == "cuda" and torch.cuda.is_available():
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    return host_memory_available() if device.type == "cpu" else None


def host_memory_available() -> int | None:
    """Bytes of host memory available (Linux's MemAvailable), or None where /proc/meminfo does not
    say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _no_memory(spec: str, num_bytes: int, dtype: str, why: str) -> str:
    return (
        f"{spec}: not enough memory for its weights ({num_bytes / 2**30:.1f} GiB in {dtype}):"
        f" {why}; allowed: a smaller model or dtype (--dtype bfloat16 halves float32), or a machine"
        " with more memory"
    )


def _model_and_weights(
    spec: str, seed: int, max_model_len: int | None
) -> tuple[LlamaForCausalLM, dict[str, tuple[int, ...]], Iterator[tuple[str, Tensor]]]:
    """The model of ``spec`` on the meta device, the shapes of the tensors it needs, and those
    tensors as they will be read (drawn from ``seed``, read from a GGUF file or a directory).
    Reads headers only."""
    if spec in TINY_MODELS:
        config = TINY_MODELS[spec]
    elif is_gguf_file(spec):
        config = read_gguf_config(Path(spec))
    else:
        config = read_config(model_directory(spec))
    model = _meta_model(_with_context(config, max_model_len, spec))
    shapes = _expected_shapes(model)
    if spec in TINY_MODELS:
        weights = _seeded_weights(shapes, seed)
    elif is_gguf_file(spec):
        weights = gguf_weights(Path(spec), shapes, model.config)
    else:
        weights = checkpoint_weights(model_directory(spec), shapes, model.config)
    return model, shapes, weights


def _with_context(config: ModelConfig, max_model_len: int | None, spec: str) -> ModelConfig:
    """``config`` with its context cut to ``max_model_len`` (None: as it is). ModelLoadError for a
    length past the model's own. Pure."""
    if max_model_len is None:
        return config
    if not 0 < max_model_len <= config.max_context:
        raise ModelLoadError(
            f"--max-model-len {max_model_len}: {spec} has a context of {config.max_context}"
            f" tokens; allowed: 1 to {config.max_context}"
        )
    return config.model_copy(update={"max_context": max_model_len})


def _parse_dtype(dtype: str) -> torch.dtype:
    if dtype not in SUPPORTED_DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r}; allowed: {', '.join(SUPPORTED_DTYPES)}")
    return SUPPORTED_DTYPES[dtype]


def _meta_model(config: ModelConfig) -> LlamaForCausalLM:
    """The model with parameters on the meta device (no memory, no init); the RoPE buffer is on
    CPU."""
    with torch.device("meta"):
        return LlamaForCausalLM(config)


def _expected_shapes(model: LlamaForCausalLM) -> dict[str, tuple[int, ...]]:
    """Every tensor to fill, under HF's names, in module order; a tied ``lm_head.weight`` is not
    listed (it is the embedding)."""
    tensors = hf_tensors(dict(model.named_parameters()), model.config)
    return {name: tuple(tensor.shape) for name, tensor in tensors.items()}


def _assign_parameter(model: LlamaForCausalLM, name: str, tensor: Tensor) -> None:
    """Make ``tensor`` the HF tensor ``name`` of ``model``: the parameter itself, or its rows of a
    stacked parameter (which is first allocated like ``tensor`` while still on the meta device).
    Mutates the owning submodule."""
    location = stacked_location(name, model.config)
    module_name, _, attr = (name if location is None else location[0]).rpartition(".")
    module = model.get_submodule(module_name)
    if location is None:
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
        return
    _, start, end = location
    stacked = getattr(module, attr)
    if stacked.is_meta:
        stacked = nn.Parameter(tensor.new_empty(stacked.shape), requires_grad=False)
        setattr(module, attr, stacked)
    stacked.data[start:end] = tensor


def _seeded_weights(shapes: dict[str, tuple[int, ...]], seed: int) -> Iterator[tuple[str, Tensor]]:
    """HF-style init: norms 1, biases 0, other weights zero-mean with std ``INIT_STD``.

    Values are uniform, drawn as integers from a CPU generator and scaled by one
    float32 multiply, so the bits are the same on every machine; the generator is
    advanced in module order.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    half_range = 2**23
    scale = INIT_STD * math.sqrt(3) / half_range  # uniform on [-a, a] has std a / sqrt(3)
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape)
        elif name.endswith(".bias"):
            yield name, torch.zeros(shape)
        else:
            draws = torch.randint(
                -half_range, half_range, shape, generator=generator, dtype=torch.int32
            )
            yield name, draws.to(torch.float32) * scale
