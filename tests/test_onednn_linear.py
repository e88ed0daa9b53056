"""Linear layers packed for oneDNN: the same outputs as ``nn.Linear`` up to summation order, the
dense weight given back exactly, and which models ``load_model`` packs (a tied lm_head too)."""

import pytest
import torch
from torch import nn

from batchgen.model.loader import load_model
from batchgen.model.onednn_linear import OneDNNLinear, can_pack, pack_linears

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="this torch build has no oneDNN"
)


def seeded_linear(bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(48, 40, bias=bias)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("num_rows", [1, 16, 33])
def test_packed_linear_computes_what_the_dense_one_does(bias, num_rows):
    dense = seeded_linear(bias)
    packed = OneDNNLinear(seeded_linear(bias))
    x = torch.randn(num_rows, 48)
    torch.testing.assert_close(packed(x), dense(x), rtol=1e-5, atol=1e-5)


def test_the_dense_weight_and_state_dict_come_back_exactly_under_nn_linears_names():
    dense = seeded_linear(bias=True)
    packed = OneDNNLinear(seeded_linear(bias=True))
    assert packed.packed_weight.is_mkldnn
    assert torch.equal(packed.weight, dense.weight)
    state = packed.state_dict()
    assert list(state) == ["weight", "bias"]
    assert torch.equal(state["weight"], dense.weight) and torch.equal(state["bias"], dense.bias)


def test_pack_linears_replaces_every_linear_but_the_skipped_ones():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 2)))
    kept = model[2][0]
    pack_linears(model, skip=(kept,))
    assert isinstance(model[0], OneDNNLinear) and isinstance(model[1], nn.ReLU)
    assert model[2][0] is kept


def test_float32_and_bfloat16_on_cpu_are_packed():
    cpu = torch.device("cpu")
    assert can_pack(cpu, torch.float32) and can_pack(cpu, torch.bfloat16)
    assert not can_pack(cpu, torch.float16)
    assert not can_pack(torch.device("meta"), torch.float32)


@pytest.mark.parametrize("num_rows", [1, 16, 33])
def test_a_packed_bfloat16_linear_computes_what_the_dense_one_does(num_rows):
    dense = seeded_linear(bias=False).bfloat16()
    packed = OneDNNLinear(seeded_linear(bias=False).bfloat16())
    x = torch.randn(num_rows, 48).bfloat16()
    assert packed(x).dtype == torch.bfloat16
    torch.testing.assert_close(packed(x), dense(x), rtol=1e-2, atol=1e-2)
    assert torch.equal(packed.weight, dense.weight)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_model_packs_cpu_models_and_saves_the_same_state_dict(dtype):
    packed = load_model("tiny", dtype=dtype)
    dense = load_model("tiny", dtype="float16")
    layer = packed.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, OneDNNLinear)
    assert isinstance(layer.mlp.down_proj, OneDNNLinear)
    assert isinstance(dense.model.layers[0].self_attn.qkv_proj, nn.Linear)
    state, dense_state = packed.state_dict(), dense.state_dict()
    assert list(state) == list(dense_state)
    # float32 -> float16 as the loader converts; bfloat16 holds fewer mantissa bits than float16
    if dtype == "float32":
        assert all(torch.equal(state[name].half(), dense_state[name]) for name in state)


def test_a_tied_lm_head_is_packed_as_a_copy_beside_the_embedding(tmp_path):
    from batchgen.validation.hf_oracle import save_hf_model

    geometry = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1)
    geometry.update(num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    save_hf_model(tmp_path, **geometry)
    model = load_model(str(tmp_path))
    assert model.config.tie_word_embeddings
    # unpacked, MKL re-packed the 49152 x 576 weight of the real model on every call
    assert isinstance(model.lm_head, OneDNNLinear)
    embedding = model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, embedding)
    hidden = torch.randn(5, 32)
    torch.testing.assert_close(model.lm_head(hidden), hidden @ embedding.T, rtol=1e-5, atol=1e-5)
    assert torch.equal(model.state_dict()["lm_head.weight"], embedding)
