"""``model.stacked``: HF's q/k/v and gate/up projections as one matrix each, named as HF names them
wherever a checkpoint is read or written."""

import torch

from batchgen.config import TINY_MODELS
from batchgen.model.loader import load_model
from batchgen.model.stacked import hf_tensors, stacked_location

CONFIG = TINY_MODELS["tiny"]
Q_ROWS = CONFIG.num_heads * CONFIG.head_dim
KV_ROWS = CONFIG.num_kv_heads * CONFIG.head_dim
INTERMEDIATE = CONFIG.intermediate_size


def test_each_hf_part_lives_in_its_rows_of_the_stacked_parameter_in_hf_order():
    attn, mlp = "model.layers.1.self_attn.", "model.layers.1.mlp."
    assert stacked_location(attn + "q_proj.weight", CONFIG) == (attn + "qkv_proj.weight", 0, Q_ROWS)
    assert stacked_location(attn + "k_proj.bias", CONFIG) == (
        attn + "qkv_proj.bias",
        Q_ROWS,
        Q_ROWS + KV_ROWS,
    )
    assert stacked_location(attn + "v_proj.weight", CONFIG) == (
        attn + "qkv_proj.weight",
        Q_ROWS + KV_ROWS,
        Q_ROWS + 2 * KV_ROWS,
    )
    assert stacked_location(mlp + "gate_proj.weight", CONFIG) == (
        mlp + "gate_up_proj.weight",
        0,
        INTERMEDIATE,
    )
    assert stacked_location(mlp + "up_proj.weight", CONFIG) == (
        mlp + "gate_up_proj.weight",
        INTERMEDIATE,
        2 * INTERMEDIATE,
    )


def test_names_kept_as_hf_has_them_have_no_stacked_location():
    for name in (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
    ):
        assert stacked_location(name, CONFIG) is None


def test_hf_tensors_splits_each_stacked_tensor_into_views_of_its_rows_and_keeps_the_rest():
    qkv = torch.arange(Q_ROWS + 2 * KV_ROWS, dtype=torch.float32)[:, None].expand(-1, 3)
    norm = torch.ones(3)
    renamed = hf_tensors(
        {"model.layers.0.self_attn.qkv_proj.weight": qkv, "model.norm.weight": norm}, CONFIG
    )
    assert list(renamed) == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.norm.weight",
    ]
    assert renamed["model.layers.0.self_attn.k_proj.weight"][:, 0].tolist() == list(
        range(Q_ROWS, Q_ROWS + KV_ROWS)
    )
    assert renamed["model.layers.0.self_attn.v_proj.weight"].data_ptr() == qkv[-KV_ROWS:].data_ptr()
    assert renamed["model.norm.weight"] is norm


def test_a_loaded_model_runs_one_matmul_for_qkv_and_one_for_gate_up_and_saves_hf_names():
    model = load_model("tiny", seed=3)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.shape == (Q_ROWS + 2 * KV_ROWS, CONFIG.hidden_size)
    assert layer.mlp.gate_up_proj.weight.shape == (2 * INTERMEDIATE, CONFIG.hidden_size)
    state = model.state_dict()
    assert not any("qkv_proj" in name or "gate_up_proj" in name for name in state)
    assert state["model.layers.0.self_attn.q_proj.weight"].shape == (Q_ROWS, CONFIG.hidden_size)
    assert torch.equal(
        torch.cat([state[f"model.layers.0.mlp.{part}_proj.weight"] for part in ("gate", "up")]),
        layer.mlp.gate_up_proj.weight,
    )
