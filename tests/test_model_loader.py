"""Loading: seeded tiny models, HF-format directories, and an error that says what is wrong for each
bad input."""

import json

import pytest
import torch
from safetensors.torch import save_file
from stepping import step_to_end

from batchgen.config import DTYPE_SIZES, TINY_MODELS, CacheConfig, ModelConfig
from batchgen.engine.worker import Worker
from batchgen.model import loader
from batchgen.model.llama import LlamaForCausalLM
from batchgen.model.loader import SUPPORTED_DTYPES, ModelLoadError, load_model
from batchgen.model.stacked import hf_tensors
from batchgen.state import Request, RequestOutput

HF_CONFIG = dict(
    model_type="llama",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=10000.0,
)
NUM_TENSORS_PER_LAYER = 9


def reference_tensors(hf_config: dict) -> dict[str, torch.Tensor]:
    """A full state dict for ``hf_config`` (default torch init), as a checkpoint would hold it."""
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(hf_config))
    # under HF's names; a tied lm_head.weight is not listed
    tensors = hf_tensors(dict(model.named_parameters()), model.config)
    return {name: tensor.detach().clone() for name, tensor in tensors.items()}


def write_checkpoint(directory, hf_config: dict = HF_CONFIG, tensors: dict | None = None):
    """config.json + model.safetensors in ``directory``; returns the tensors written."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors = reference_tensors(hf_config) if tensors is None else tensors
    (directory / "config.json").write_text(json.dumps(hf_config))
    save_file(tensors, directory / "model.safetensors")
    return tensors


def assert_weights_equal(model, tensors: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert set(state) - {"lm_head.weight"} == set(tensors) - {"lm_head.weight"}
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name


# --- seeded tiny models ---------------------------------------------------------------------------


def test_same_seed_gives_identical_weights():
    first, second = (
        load_model("tiny", seed=11).state_dict(),
        load_model("tiny", seed=11).state_dict(),
    )
    assert list(first) == list(second)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_different_seed_gives_different_weights():
    first, second = load_model("tiny", seed=0).state_dict(), load_model("tiny", seed=1).state_dict()
    for name in first:
        if not name.endswith("norm.weight"):
            assert not torch.equal(first[name], second[name]), name


def test_seeded_weights_are_pinned_bit_for_bit():
    weights = load_model("tiny", seed=0).state_dict()
    assert weights["model.embed_tokens.weight"][0, :3].tolist() == [
        -0.00025935107260011137,
        0.01858295127749443,
        -0.02851112000644207,
    ]
    assert weights["lm_head.weight"][-1, -3:].tolist() == [
        -0.033597320318222046,
        0.009402421303093433,
        0.01250363327562809,
    ]


def test_seeded_init_is_hf_like():
    weights = load_model("tiny").state_dict()
    embedding = weights["model.embed_tokens.weight"]
    assert abs(embedding.std().item() - 0.02) < 0.001 and abs(embedding.mean().item()) < 0.001
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    assert torch.equal(weights["model.layers.1.input_layernorm.weight"], torch.ones(64))


def test_bfloat16_load_is_the_float32_weights_rounded():
    full, half = (
        load_model("tiny", seed=2).state_dict(),
        load_model("tiny", seed=2, dtype="bfloat16").state_dict(),
    )
    for name in full:
        assert half[name].dtype == torch.bfloat16
        assert torch.equal(half[name], full[name].bfloat16()), name


def test_loaded_model_has_no_meta_tensors_and_no_grad():
    model = load_model("tiny")
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    assert not any(p.requires_grad for p in model.parameters())


# --- HF-format directories ------------------------------------------------------------------------


def test_directory_checkpoint_loads_every_tensor(tmp_path):
    tensors = write_checkpoint(tmp_path)
    assert_weights_equal(load_model(str(tmp_path)), tensors)


def write_two_shards(directory, tensors: dict, first: slice, second: slice) -> None:
    """config.json, two shards holding the tensors at ``first`` and ``second`` (in order), and their
    index."""
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[first],
        "model-00002-of-00002.safetensors": names[second],
    }
    for shard, shard_names in shards.items():
        save_file({name: tensors[name] for name in shard_names}, directory / shard)
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    (directory / "config.json").write_text(json.dumps(HF_CONFIG))


def test_sharded_checkpoint_loads_through_its_index(tmp_path):
    tensors = reference_tensors(HF_CONFIG)
    write_two_shards(tmp_path, tensors, slice(None, 7), slice(7, None))
    assert_weights_equal(load_model(str(tmp_path)), tensors)


def test_a_tensor_in_two_shards_is_refused_naming_both(tmp_path):
    tensors = reference_tensors(HF_CONFIG)
    write_two_shards(tmp_path, tensors, slice(None, 7), slice(6, None))
    names = list(tensors)
    assert (
        load_error(str(tmp_path))
        == f"{tmp_path / 'model-00002-of-00002.safetensors'}: tensor {names[6]} is also in "
        "model-00001-of-00002.safetensors; each tensor must be in exactly one safetensors file"
    )


def test_tied_embeddings_share_one_parameter(tmp_path):
    tensors = write_checkpoint(tmp_path, dict(HF_CONFIG, tie_word_embeddings=True))
    assert "lm_head.weight" not in tensors
    model = load_model(str(tmp_path), dtype="float16")  # unpacked (float32, bfloat16 are packed)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"].half())


def test_tied_checkpoint_that_also_stores_lm_head_loads(tmp_path):
    config = dict(HF_CONFIG, tie_word_embeddings=True)
    tensors = reference_tensors(config)
    write_checkpoint(
        tmp_path,
        config,
        {**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()},
    )
    model = load_model(str(tmp_path))
    # packed for oneDNN: a copy of the embedding's values (onednn_linear)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert torch.equal(model.model.embed_tokens.weight, tensors["model.embed_tokens.weight"])


def test_rotary_inv_freq_buffers_are_ignored(tmp_path):
    tensors = reference_tensors(HF_CONFIG)
    write_checkpoint(
        tmp_path, tensors={**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(2)}
    )
    assert_weights_equal(load_model(str(tmp_path)), tensors)


def test_rope_theta_is_read_from_transformers5_rope_parameters(tmp_path):
    config = {k: v for k, v in HF_CONFIG.items() if k != "rope_theta"}
    write_checkpoint(
        tmp_path, dict(config, rope_parameters={"rope_theta": 500000.0, "rope_type": "default"})
    )
    assert load_model(str(tmp_path)).config.rope_theta == 500000.0


# --- errors ---------------------------------------------------------------------------------------


def load_error(spec: str, **kwargs) -> str:
    with pytest.raises(ModelLoadError) as caught:
        load_model(spec, **kwargs)
    return str(caught.value)


def test_model_load_error_is_a_value_error():
    assert issubclass(ModelLoadError, ValueError)


def test_unknown_name_lists_the_names_and_allows_a_directory():
    message = load_error("tinyy")
    assert "unknown model name 'tinyy'" in message
    assert "tiny, llama2-7b-geometry" in message and "directory" in message


def test_missing_directory_is_named(tmp_path):
    missing = tmp_path / "absent"
    assert load_error(str(missing)) == f"{missing}: directory does not exist"


def test_a_file_is_not_a_model_directory(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_text("")
    assert f"{path}: is a file" in load_error(str(path))


def test_missing_config_json(tmp_path):
    save_file(reference_tensors(HF_CONFIG), tmp_path / "model.safetensors")
    assert load_error(str(tmp_path)).startswith(f"{tmp_path / 'config.json'}: missing")


def test_config_json_that_is_not_json(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{vocab_size: 32")
    assert f"{tmp_path / 'config.json'}: not valid JSON" in load_error(str(tmp_path))


def test_config_json_missing_a_key(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in HF_CONFIG.items() if k != "hidden_size"})
    )
    assert load_error(str(tmp_path)) == f"{tmp_path / 'config.json'}: missing key 'hidden_size'"


def test_config_json_with_invalid_geometry(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(HF_CONFIG, num_key_value_heads=3)))
    message = load_error(str(tmp_path))
    assert (
        "config.json: invalid model config" in message
        and "must be a multiple of num_kv_heads (3)" in message
    )


def test_scaled_rope_is_rejected(tmp_path):
    write_checkpoint(tmp_path)
    rope_scaling = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(dict(HF_CONFIG, rope_scaling=rope_scaling)))
    assert "rope_type 'llama3' is not supported; allowed: 'default'" in load_error(str(tmp_path))


def test_sliding_window_attention_is_rejected(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps(dict(HF_CONFIG, use_sliding_window=True, sliding_window=64))
    )
    assert "use_sliding_window is not supported" in load_error(str(tmp_path))


def test_mistral_sliding_window_is_rejected_and_a_null_one_loads(tmp_path):
    write_checkpoint(tmp_path)
    mistral = dict(HF_CONFIG, model_type="mistral", architectures=["MistralForCausalLM"])
    (tmp_path / "config.json").write_text(json.dumps(dict(mistral, sliding_window=64)))
    assert "sliding_window 64 is not supported; allowed: null" in load_error(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(dict(mistral, sliding_window=None)))
    load_model(str(tmp_path))


@pytest.mark.parametrize("where", ["top level", "rope_parameters"])
def test_partial_rotary_embedding_is_rejected_and_a_factor_of_one_loads(tmp_path, where):
    write_checkpoint(tmp_path)

    def config(factor):
        if where == "top level":
            return dict(HF_CONFIG, partial_rotary_factor=factor)
        return dict(
            HF_CONFIG, rope_parameters={"rope_type": "default", "partial_rotary_factor": factor}
        )

    key = (
        "partial_rotary_factor" if where == "top level" else "rope_parameters.partial_rotary_factor"
    )
    for factor in (0.5, "1", True):
        (tmp_path / "config.json").write_text(json.dumps(config(factor)))
        assert f"{key} {factor!r} is not supported; allowed: 1 or null" in load_error(str(tmp_path))
    for factor in (1, 1.0, None):
        (tmp_path / "config.json").write_text(json.dumps(config(factor)))
        load_model(str(tmp_path))


def test_non_silu_activation_is_rejected(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(HF_CONFIG, hidden_act="gelu")))
    assert "hidden_act 'gelu' is not supported; allowed: 'silu'" in load_error(str(tmp_path))


def test_directory_without_safetensors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    message = load_error(str(tmp_path))
    assert message.startswith(f"{tmp_path}: no safetensors files")
    assert "model.safetensors" in message and "model.safetensors.index.json" in message


def test_index_naming_a_missing_shard(tmp_path):
    tensors = write_checkpoint(tmp_path)
    weight_map = {name: "model.safetensors" for name in tensors}
    weight_map["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    message = load_error(str(tmp_path))
    assert (
        message == f"{tmp_path / 'model.safetensors.index.json'}: names 1 shard(s) missing from"
        f" {tmp_path}: "
        "model-00002-of-00002.safetensors"
    )


def test_unreadable_safetensors_file(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    assert f"{tmp_path / 'model.safetensors'}: not a readable safetensors file" in load_error(
        str(tmp_path)
    )


def test_missing_tensors_are_counted_and_five_named(tmp_path):
    tensors = reference_tensors(HF_CONFIG)
    layer_1 = [name for name in tensors if name.startswith("model.layers.1.")]
    assert len(layer_1) == NUM_TENSORS_PER_LAYER
    write_checkpoint(tmp_path, tensors={k: v for k, v in tensors.items() if k not in layer_1})
    message = load_error(str(tmp_path))
    assert f"{tmp_path}: 9 tensor(s) missing from the checkpoint" in message
    assert sum(name in message for name in layer_1) == 5


def test_untied_checkpoint_without_lm_head_is_missing_it(tmp_path):
    tensors = reference_tensors(HF_CONFIG)
    del tensors["lm_head.weight"]
    write_checkpoint(tmp_path, tensors=tensors)
    assert "1 tensor(s) missing from the checkpoint, e.g. lm_head.weight" in load_error(
        str(tmp_path)
    )


def test_unexpected_tensors_are_named(tmp_path):
    tensors = reference_tensors(HF_CONFIG)
    write_checkpoint(
        tmp_path, tensors={**tensors, "model.layers.2.mlp.up_proj.weight": torch.ones(32, 16)}
    )
    message = load_error(str(tmp_path))
    assert "1 tensor(s) the model does not have, e.g. model.layers.2.mlp.up_proj.weight" in message


def test_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
    tensors = reference_tensors(HF_CONFIG)
    write_checkpoint(
        tmp_path, tensors={**tensors, "model.layers.0.self_attn.k_proj.weight": torch.ones(16, 16)}
    )
    message = load_error(str(tmp_path))
    assert (
        "tensor model.layers.0.self_attn.k_proj.weight has shape [16, 16], expected [8, 16]"
        in message
    )


def test_unsupported_dtype_lists_the_allowed_ones():
    assert (
        load_error("tiny", dtype="float64")
        == "unsupported dtype 'float64'; allowed: float32, bfloat16, float16"
    )


def test_every_cache_dtype_is_a_torch_dtype_of_the_size_the_plan_layer_counts():
    assert {
        name: torch.empty(0, dtype=dtype).element_size() for name, dtype in SUPPORTED_DTYPES.items()
    } == DTYPE_SIZES


def test_every_id_of_an_eos_token_id_list_ends_a_request(tmp_path):
    write_checkpoint(tmp_path)
    prompt = Request("r0", (1, 2, 3), max_new_tokens=4, temperature=0.0, seed=0)

    def generate(model) -> RequestOutput:
        worker = Worker(
            model, cache_config=CacheConfig(page_size=4, num_gpu_pages=8, num_host_pages=0)
        )
        worker.add_request(prompt)
        step_to_end(worker, 100)
        return worker.take_outputs()["r0"]

    first = generate(load_model(str(tmp_path))).output_ids[0]
    other = (first + 1) % HF_CONFIG["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(dict(HF_CONFIG, eos_token_id=[other, first])))
    output = generate(load_model(str(tmp_path)))
    # the second id ends it too
    assert (output.output_ids, output.finish_reason) == ((first,), "eos")


def tiny_weight_bytes(dtype: str) -> int:
    model = LlamaForCausalLM(TINY_MODELS["tiny"])
    return sum(param.numel() for param in model.parameters()) * DTYPE_SIZES[dtype]


def test_a_model_larger_than_the_memory_available_is_refused_before_any_weight_is_made(monkeypatch):
    num_bytes = tiny_weight_bytes("float32")
    monkeypatch.setattr(loader, "host_memory_available", lambda: num_bytes - 1)
    made = []
    monkeypatch.setattr(loader, "_assign_parameter", lambda *args: made.append(args))
    with pytest.raises(ModelLoadError) as refused:
        load_model("tiny")
    assert (
        str(refused.value)
        == f"tiny: not enough memory for its weights ({num_bytes / 2**30:.1f} GiB in float32):"
        f" {(num_bytes - 1) / 2**30:.1f} GiB is available on cpu; allowed: a smaller model or"
        " dtype (--dtype bfloat16 halves float32), or a machine with more memory"
    )
    assert made == []
    monkeypatch.undo()
    half = tiny_weight_bytes("bfloat16")
    monkeypatch.setattr(loader, "host_memory_available", lambda: half)
    # it fits
    assert load_model("tiny", dtype="bfloat16").model.embed_tokens.weight.dtype == torch.bfloat16


def test_an_allocation_the_cpu_refuses_while_loading_is_a_load_error(monkeypatch):
    def refused(*args):
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 4096 bytes. Error code 12 (Cannot allocate memory)"
        )

    monkeypatch.setattr(loader, "_assign_parameter", refused)
    with pytest.raises(
        ModelLoadError,
        match=r"^tiny: not enough memory for its weights \(.* GiB in float32\): "
        r"the CPU allocator refused; allowed: ",
    ):
        load_model("tiny")


def test_another_runtime_error_while_loading_is_not_called_a_memory_error(monkeypatch):
    def broken(*args):
        raise RuntimeError("something else")

    monkeypatch.setattr(loader, "_assign_parameter", broken)
    with pytest.raises(RuntimeError, match="^something else$"):
        load_model("tiny")


def test_a_gpu_counts_the_memory_torch_caches_unused_as_available(monkeypatch):
    """Pools a finished worker freed stay reserved by torch's caching allocator, which the next
    worker reuses: the driver's free figure alone would refuse it."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (3 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 10 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 4 * 2**30)
    assert loader.device_memory_available(torch.device("cuda", 0)) == (3 + 10 - 4) * 2**30
