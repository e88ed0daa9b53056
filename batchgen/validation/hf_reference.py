"""The real model as an HF directory made by transformers, independently of batchgen's GGUF reader:
transformers' own GGUF loading (it needs ``gguf`` and ``accelerate``, dev extras), then
``save_pretrained`` as today's transformers writes it (``chat_template.jinja`` beside
``tokenizer_config.json``, ``rope_parameters``, ``generation_config.json``).

transformers refuses to save a model flagged as GGUF-quantized, so a plain model is rebuilt from
the config without ``quantization_config`` and given the dequantized state dict. Made once into
``cache_dir()/smollm2/hf-reference``, under a temporary name renamed when whole.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from batchgen.model.real_model import MODEL_FOLDER, cache_dir, fetch_real_model

REFERENCE_FOLDER = "hf-reference"


def reference_directory(cache: Path | None = None) -> Path:
    """transformers' HF directory of the real model, made first unless it is in ``cache``. Fetches
    the GGUF file if needed; writes into ``cache``."""
    target = (cache or cache_dir()) / MODEL_FOLDER / REFERENCE_FOLDER
    if (target / "model.safetensors").is_file():
        return target
    gguf_file = fetch_real_model(cache)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".reference-") as scratch:
        partial = Path(scratch) / REFERENCE_FOLDER
        _save_with_transformers(gguf_file, partial)
        try:
            partial.replace(target)
        except OSError:  # another process made it first (test workers run side by side)
            if not (target / "model.safetensors").is_file():
                raise
    return target


def _save_with_transformers(gguf_file: Path, out: Path) -> None:
    """transformers' load of ``gguf_file`` (model and tokenizer), saved to ``out``. Writes
    ``out``."""
    import torch
    import transformers

    folder, name = str(gguf_file.parent), gguf_file.name
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    plain = type(loaded)(type(loaded.config).from_dict(settings))
    plain.load_state_dict(loaded.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
