"""``batchgen make-checkpoint DIR``: the seeded tiny model as an HF checkpoint directory, with a
byte-level BPE trained here on a few sentences and a chat template, so ``generate`` has a real
model directory to run on without a download.

::

    DIR/config.json              LlamaConfig keys of TINY_MODELS["tiny"] (vocab 512), bos/eos ids
    DIR/model.safetensors        load_model("tiny", seed=SEED)'s weights, under HF's names
    DIR/generation_config.json   bos/eos ids
    DIR/tokenizer.json           the BPE (tokenizers' format): <s> prepended to every encoding
    DIR/tokenizer_config.json    PreTrainedTokenizerFast, special tokens, the chat template
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from batchgen.config import TINY_MODELS
from batchgen.model.loader import load_model

BOS, EOS = "<s>", "</s>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# Each message is its role's token, its content and EOS; the prompt ends with the assistant's token.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>"
    "{{ message['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = (
    "Once upon a time there was a small model that generated text in batches.",
    "The cache keeps pages of keys and values on the GPU and on the host.",
    "When memory runs short the worker evicts a request to the host and loads it back later.",
    "A batch job is a file of requests, one JSON line each, and a file of results.",
    "Hello! How are you today? I am fine, thank you, and you?",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "Numbers like 1, 2, 3, 42 and 2048 appear in logs, traces and reports.",
    "Tokens are sampled greedily or with a temperature, top-k, top-p and min-p.",
    "Every divergence between the two paths is logged with enough state to replay it.",
    "She sells sea shells by the sea shore; the shells she sells are surely sea shells.",
)


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE of exactly ``vocab_size`` tokens trained on ``CORPUS`` (ids 0 and 1: BOS,
    EOS; then the role tokens); ValueError when the corpus yields fewer merges. Pure."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the tokenizer corpus gave {tokenizer.get_vocab_size()} tokens, not {vocab_size}"
        )
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tokenizer


def make_checkpoint(directory: str | Path, seed: int = 0) -> Path:
    """Write the tiny checkpoint (see the module docstring) into ``directory``, created if needed;
    returns its path. Mutates the file system."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = TINY_MODELS["tiny"]
    bos_id, eos_id = write_tokenizer_files(path, config.vocab_size, config.max_context)
    model = load_model("tiny", seed=seed)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors"
    )
    hf_config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_context,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    _write_json(path / "config.json", hf_config)
    _write_json(path / "generation_config.json", {"bos_token_id": bos_id, "eos_token_id": eos_id})
    return path


def write_tokenizer_files(directory: Path, vocab_size: int, max_context: int) -> tuple[int, int]:
    """The trained BPE's ``tokenizer.json`` and a ``tokenizer_config.json`` with the chat template,
    in ``directory``; returns the BOS and EOS ids. Mutates the file system."""
    tokenizer = train_tokenizer(vocab_size)
    tokenizer.save(str(directory / "tokenizer.json"))
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "model_max_length": max_context,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    return tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
