"""GGUF model files: metadata -> ModelConfig, llama.cpp tensors -> HF names, dequantized, with
Llama's q/k row permutation undone; small files written here with gguf's own writer, and the real
SmolLM2 file checked against transformers' load of it."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open

from batchgen.config import TINY_MODELS
from batchgen.model import loader
from batchgen.model.gguf_checkpoint import gguf_weights, is_gguf_file, read_gguf_config
from batchgen.model.hf_checkpoint import ModelLoadError, read_config
from batchgen.model.loader import load_model

F32, F16, Q8_0 = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.Q8_0,
)
TINY = TINY_MODELS["tiny"]
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    """llama.cpp's name for an HF tensor name."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf's permutation of a Llama q or k projection's rows."""
    grouped = rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:])
    return grouped.swapaxes(1, 2).reshape(rows.shape)


def tiny_metadata(arch: str = "llama", config=TINY) -> dict:
    return {
        f"{arch}.block_count": config.num_layers,
        f"{arch}.context_length": config.max_context,
        f"{arch}.embedding_length": config.hidden_size,
        f"{arch}.feed_forward_length": config.intermediate_size,
        f"{arch}.attention.head_count": config.num_heads,
        f"{arch}.attention.head_count_kv": config.num_kv_heads,
        f"{arch}.rope.freq_base": config.rope_theta,
        f"{arch}.attention.layer_norm_rms_epsilon": config.rms_norm_eps,
        f"{arch}.vocab_size": config.vocab_size,
        f"{arch}.rope.dimension_count": config.head_dim,
    }


def add_metadata(writer: gguf.GGUFWriter, metadata: dict) -> None:
    for key, value in metadata.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)


def write_gguf(path, tensors: dict, metadata: dict, arch="llama", qtype=F32, permute=True):
    """A GGUF file of ``tensors`` (HF names, torch) as llama.cpp writes them: llama.cpp names, q/k
    rows permuted for ``arch`` llama, norms in F32 and the rest in ``qtype`` (None: each tensor's
    own dtype). Returns ``path``."""
    writer = gguf.GGUFWriter(str(path), arch)
    add_metadata(writer, metadata)
    heads = {"q_proj": metadata.get(f"{arch}.attention.head_count")}
    heads["k_proj"] = metadata.get(f"{arch}.attention.head_count_kv")
    for name, tensor in tensors.items():
        values = tensor.numpy()
        module = name.rsplit(".", 2)[-2]
        if permute and arch == "llama" and module in heads:
            values = llama_cpp_permute(values, heads[module])
        if qtype is None:
            writer.add_tensor(gguf_name(name), values)
        elif values.ndim == 1 or qtype == F32:
            writer.add_tensor(gguf_name(name), values.astype(np.float32))
        elif qtype == F16:
            writer.add_tensor(gguf_name(name), values.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_tensors() -> dict[str, torch.Tensor]:
    """The seeded tiny model's weights under HF's names."""
    return {name: t.clone() for name, t in load_model("tiny").state_dict().items()}


@pytest.fixture
def tiny_file(tmp_path, tiny_tensors):
    return write_gguf(tmp_path / "tiny.gguf", tiny_tensors, tiny_metadata())


def expected_shapes(config) -> dict[str, tuple[int, ...]]:
    """The HF tensors a model of ``config`` is loaded from, and their shapes."""
    return loader._expected_shapes(loader._meta_model(config))


def random_tensors(config, seed: int) -> dict[str, torch.Tensor]:
    """Standard-normal values for every HF tensor of a model of ``config``, biases included."""
    generator = torch.Generator().manual_seed(seed)
    shapes = expected_shapes(config)
    return {name: torch.randn(shape, generator=generator) for name, shape in shapes.items()}


def loaded_tensors(path) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in load_model(str(path)).state_dict().items()}


def test_is_gguf_file_is_the_suffix_in_any_case():
    assert all(map(is_gguf_file, ("m.gguf", "M.GGUF", "/models/x.Q4_1.Gguf", "rel/y.gguf")))
    assert not any(map(is_gguf_file, ("tiny", "dir/", "x.gguf.part", "gguf", "x.safetensors")))


def test_f32_file_loads_the_exact_weights_with_q_and_k_unpermuted(tiny_file, tiny_tensors):
    query = tiny_tensors["model.layers.0.self_attn.q_proj.weight"].numpy()
    assert not np.array_equal(llama_cpp_permute(query, TINY.num_heads), query)
    loaded = loaded_tensors(tiny_file)
    assert loaded.keys() == tiny_tensors.keys()
    for name, tensor in tiny_tensors.items():
        assert torch.equal(loaded[name], tensor), name


def test_config_fields_are_the_metadata(tiny_file):
    float32_eps = float(np.float32(TINY.rms_norm_eps))
    assert read_gguf_config(tiny_file) == TINY.model_copy(update={"rms_norm_eps": float32_eps})


def test_f16_weights_are_the_float32_weights_rounded_to_f16(tmp_path, tiny_tensors):
    path = write_gguf(tmp_path / "f16.gguf", tiny_tensors, tiny_metadata(), qtype=F16)
    loaded = loaded_tensors(path)
    for name, tensor in tiny_tensors.items():
        expected = tensor if tensor.ndim == 1 else tensor.half().float()
        assert torch.equal(loaded[name], expected), name


def test_q8_0_weights_are_within_half_a_step_of_each_block(tmp_path, tiny_tensors):
    path = write_gguf(tmp_path / "q8.gguf", tiny_tensors, tiny_metadata(), qtype=Q8_0)
    loaded = loaded_tensors(path)
    for name, tensor in tiny_tensors.items():
        if tensor.ndim == 1:
            assert torch.equal(loaded[name], tensor), name
            continue
        blocks, got = tensor.reshape(-1, 32), loaded[name].reshape(-1, 32)
        step = blocks.abs().amax(dim=1, keepdim=True) / 127
        # half a step of rounding, plus the f16 scale's own rounding (2^-11 of the largest value)
        assert ((got - blocks).abs() <= step * 0.5 + step * 127 * 2**-10).all(), name


def test_qwen2_file_is_not_unpermuted_and_keeps_its_biases(tmp_path):
    config = TINY.model_copy(update={"attention_bias": True, "tie_word_embeddings": True})
    tensors = random_tensors(config, seed=0)
    assert "lm_head.weight" not in tensors
    assert tensors["model.layers.0.self_attn.k_proj.bias"].abs().sum() > 0
    path = write_gguf(tmp_path / "qwen.gguf", tensors, tiny_metadata("qwen2"), arch="qwen2")
    assert read_gguf_config(path).attention_bias and read_gguf_config(path).tie_word_embeddings
    loaded = dict(
        gguf_weights(path, expected_shapes(read_gguf_config(path)), read_gguf_config(path))
    )
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name


def test_a_llama_files_q_and_k_biases_are_unpermuted_too(tmp_path):
    tensors = random_tensors(TINY.model_copy(update={"attention_bias": True}), seed=1)
    path = write_gguf(tmp_path / "bias.gguf", tensors, tiny_metadata())
    loaded = dict(
        gguf_weights(path, expected_shapes(read_gguf_config(path)), read_gguf_config(path))
    )
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name


def test_without_output_weight_the_embeddings_are_tied(tmp_path, tiny_tensors):
    tensors = {n: t for n, t in tiny_tensors.items() if n != "lm_head.weight"}
    path = write_gguf(tmp_path / "tied.gguf", tensors, tiny_metadata())
    model = load_model(str(path))
    assert model.config.tie_word_embeddings
    assert torch.equal(model.state_dict()["lm_head.weight"], tensors["model.embed_tokens.weight"])


def test_vocab_size_comes_from_the_token_list_without_the_key(tmp_path, tiny_tensors):
    metadata = tiny_metadata()
    del metadata["llama.vocab_size"]
    metadata["tokenizer.ggml.tokens"] = [f"t{i}" for i in range(TINY.vocab_size)]
    metadata["tokenizer.ggml.eos_token_id"] = 3
    metadata["tokenizer.ggml.eot_token_id"] = 7
    config = read_gguf_config(write_gguf(tmp_path / "v.gguf", tiny_tensors, metadata))
    assert config.vocab_size == TINY.vocab_size and config.eos_token_ids == (3, 7)


# --- errors ---------------------------------------------------------------------------------------


def load_error(path) -> str:
    with pytest.raises(ModelLoadError) as caught:
        load_model(str(path))
    return str(caught.value)


def test_a_missing_file_is_named(tmp_path):
    path = tmp_path / "absent.gguf"
    assert load_error(path) == f"{path}: does not exist; allowed: the path of a GGUF model file"


@pytest.mark.parametrize("keep", [0, 10, 100, 1000, -100])
def test_a_truncated_file_is_not_a_readable_gguf_file(tiny_file, keep):
    data = tiny_file.read_bytes()
    tiny_file.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    message = load_error(tiny_file)
    assert message.startswith(f"{tiny_file}: not a readable GGUF file (")
    assert message.endswith("); allowed: a complete GGUF v2 or v3 file as llama.cpp writes it")
    assert "\n" not in message


def test_a_file_that_is_not_gguf_says_its_magic_is_wrong(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_text("this is not a model, just text long enough to be read as one" * 4)
    assert "GGUF magic invalid" in load_error(path)


def test_an_unknown_architecture_is_named_with_the_allowed_ones(tmp_path, tiny_tensors):
    path = write_gguf(tmp_path / "p.gguf", tiny_tensors, tiny_metadata("phi3"), arch="phi3")
    assert load_error(path) == (
        f"{path}: general.architecture 'phi3' is not supported; allowed: 'llama', 'qwen2'"
    )


def test_a_missing_metadata_key_is_named(tmp_path, tiny_tensors):
    metadata = tiny_metadata()
    del metadata["llama.block_count"]
    path = write_gguf(tmp_path / "m.gguf", tiny_tensors, metadata)
    assert load_error(path) == (
        f"{path}: metadata key 'llama.block_count' missing; a GGUF model file needs it"
    )


def test_metadata_of_the_wrong_type_is_named_by_its_gguf_key(tmp_path, tiny_tensors):
    metadata = {**tiny_metadata(), "llama.block_count": "two"}
    path = write_gguf(tmp_path / "t.gguf", tiny_tensors, metadata)
    assert load_error(path).startswith(
        f"{path}: invalid model metadata: llama.block_count: Input should be a valid integer"
    )


def test_a_type_that_cannot_be_dequantized_names_the_type_and_the_tensor(tmp_path, tiny_tensors):
    up = "model.layers.0.mlp.up_proj.weight"
    tensors = {name: t.double() if name == up else t for name, t in tiny_tensors.items()}
    path = write_gguf(tmp_path / "f64.gguf", tensors, tiny_metadata(), qtype=None)
    message = load_error(path)
    assert message.startswith(
        f"{path}: tensor blk.0.ffn_up.weight is stored as F64, which cannot be dequantized;"
        " allowed: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K"
    )
    assert "Q4_K" in message and "IQ4_XS" in message and "BF16" in message


def test_a_missing_tensor_is_named_by_its_hf_name(tmp_path, tiny_tensors):
    tensors = {n: t for n, t in tiny_tensors.items() if n != "model.layers.1.mlp.up_proj.weight"}
    path = write_gguf(tmp_path / "m.gguf", tensors, tiny_metadata())
    assert load_error(path) == (
        f"{path}: 1 tensor(s) missing from the file, e.g. model.layers.1.mlp.up_proj.weight"
    )


def test_a_tensor_the_model_does_not_have_is_named_by_its_gguf_name(tmp_path, tiny_tensors):
    tensors = {**tiny_tensors, "rope_freqs.weight": torch.ones(TINY.head_dim // 2)}
    path = tmp_path / "r.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    add_metadata(writer, tiny_metadata())
    for name, tensor in tensors.items():
        writer.add_tensor(name if name == "rope_freqs.weight" else gguf_name(name), tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert load_error(path) == (
        f"{path}: 1 tensor(s) the model does not have, e.g. rope_freqs.weight"
    )


def test_a_shape_other_than_the_metadata_says_is_named(tmp_path, tiny_tensors):
    metadata = {**tiny_metadata(), "llama.feed_forward_length": 2 * TINY.intermediate_size}
    path = write_gguf(tmp_path / "s.gguf", tiny_tensors, metadata)
    assert load_error(path) == (
        f"{path}: tensor blk.0.ffn_gate.weight (model.layers.0.mlp.gate_proj.weight) has shape"
        f" [128, 64], expected [256, 64] from the file's metadata"
    )


def test_partial_rotary_and_scaled_rope_are_refused(tmp_path, tiny_tensors):
    partial = write_gguf(
        tmp_path / "p.gguf", tiny_tensors, {**tiny_metadata(), "llama.rope.dimension_count": 8}
    )
    assert load_error(partial) == (
        f"{partial}: llama.rope.dimension_count 8 is not supported; allowed: 16, the head"
        " dimension (RoPE on every dimension of a head)"
    )
    scaled = write_gguf(
        tmp_path / "s.gguf", tiny_tensors, {**tiny_metadata(), "llama.rope.scaling.type": "yarn"}
    )
    assert load_error(scaled) == (
        f"{scaled}: llama.rope.scaling.type 'yarn' is not supported; allowed: 'none'"
        " (unscaled RoPE)"
    )


def test_a_file_that_is_not_gguf_or_a_directory_mentions_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_text("")
    message = load_error(path)
    assert message.startswith(f"{path}: is a file;") and ".gguf file" in message


# --- the real model -------------------------------------------------------------------------------


def test_real_model_config_is_transformers_config(real_model_gguf, real_model_hf_dir):
    assert read_gguf_config(real_model_gguf) == read_config(real_model_hf_dir)


def test_real_model_weights_are_transformers_weights_bit_for_bit(
    real_model_gguf, real_model_hf_dir
):
    """Both dequantize the same Q4_1/Q8_0 blocks in float32, so every bit agrees."""
    config = read_gguf_config(real_model_gguf)
    shapes = expected_shapes(config)
    seen = set()
    with safe_open(real_model_hf_dir / "model.safetensors", framework="pt") as reference:
        for name, tensor in gguf_weights(real_model_gguf, shapes, config):
            expected = reference.get_tensor(name)
            assert tensor.dtype == expected.dtype == torch.float32, name
            assert torch.equal(tensor, expected), name
            seen.add(name)
    assert seen == shapes.keys() and len(seen) == 2 + 9 * config.num_layers
