"""Linear layers packed for oneDNN: the same outputs as ``nn.Linear`` up to summation order, the
dense weight given back exactly, and which models ``load_model`` packs."""

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


def test_only_float32_on_cpu_is_packed():
    cpu = torch.device("cpu")
    assert can_pack(cpu, torch.float32)
    assert not can_pack(cpu, torch.bfloat16)
    assert not can_pack(torch.device("meta"), torch.float32)


def test_load_model_packs_float32_cpu_models_and_saves_the_same_state_dict():
    packed = load_model("tiny")
    dense = load_model("tiny", dtype="bfloat16")
    layer = packed.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, OneDNNLinear)
    assert isinstance(layer.mlp.down_proj, OneDNNLinear)
    assert isinstance(dense.model.layers[0].self_attn.qkv_proj, nn.Linear)
    state, dense_state = packed.state_dict(), dense.state_dict()
    assert list(state) == list(dense_state)
    assert all(torch.equal(state[name].bfloat16(), dense_state[name]) for name in state)
