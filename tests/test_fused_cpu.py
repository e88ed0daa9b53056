"""The fused CPU kernels compute what the torch ops they replace compute: RoPE with its exact
bits, the residual sum exactly and its RMSNorm to float32 rounding, the MLP's SiLU and product
within three ulp; only float32 on a CPU takes them."""

import pytest
import torch
import torch.nn.functional as F

from batchgen.model.elementwise import RMSNorm, apply_rope, fuses_on_cpu, rope_split, silu_and_mul


def rope_tables(num_rows: int, head_dim: int, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [N, 1, d] as ``RotaryEmbedding`` lays them out, for random angles."""
    angles = torch.rand(num_rows, 1, head_dim // 2, generator=generator) * 100
    angles = torch.cat((angles, angles), dim=-1)
    half = head_dim // 2
    signed_sin = torch.cat((-angles[..., :half].sin(), angles[..., half:].sin()), dim=-1)
    return angles.cos(), signed_sin


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 8), (6, 6, 4), (2, 1, 64)]
)
def test_rope_split_gives_apply_ropes_bits_and_writes_the_new_kv_into_its_layers_slot(
    num_heads, num_kv_heads, head_dim
):
    generator = torch.Generator().manual_seed(0)
    num_rows = 5
    qkv = torch.randn(num_rows, num_heads + 2 * num_kv_heads, head_dim, generator=generator)
    cos, sin = rope_tables(num_rows, head_dim, generator)
    forward_kv = torch.full((3, 2, num_rows, num_kv_heads, head_dim), torch.nan)
    q = rope_split(qkv, cos, sin, num_heads, forward_kv[1])
    roped = apply_rope(qkv[:, : num_heads + num_kv_heads], cos, sin)
    assert torch.equal(q, roped[:, :num_heads])
    assert torch.equal(forward_kv[1, 0], roped[:, num_heads:])
    assert torch.equal(forward_kv[1, 1], qkv[:, num_heads + num_kv_heads :])
    # the other layers' slots untouched
    assert forward_kv[0].isnan().all() and forward_kv[2].isnan().all()


def test_rope_split_in_bfloat16_takes_the_torch_path_with_the_same_layout():
    generator = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, 8, 8, generator=generator).bfloat16()
    cos, sin = (t.bfloat16() for t in rope_tables(3, 8, generator))
    new_kv = torch.empty(2, 3, 2, 8, dtype=torch.bfloat16)
    q = rope_split(qkv, cos, sin, num_heads=4, kv_out=new_kv)
    assert torch.equal(q, apply_rope(qkv[:, :4], cos, sin))
    assert torch.equal(new_kv[0], apply_rope(qkv[:, 4:6], cos, sin))
    assert torch.equal(new_kv[1], qkv[:, 6:])


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm in float32."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def seeded_norm(hidden_size: int) -> RMSNorm:
    norm = RMSNorm(hidden_size, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden_size, generator=torch.Generator().manual_seed(2)) + 0.5)
    return norm


@pytest.mark.parametrize("hidden_size", [8, 96, 512])
def test_the_norm_with_a_residual_writes_the_exact_sum_into_x_and_norms_it(hidden_size):
    generator = torch.Generator().manual_seed(3)
    norm = seeded_norm(hidden_size)
    x, residual = (torch.randn(7, hidden_size, generator=generator) for _ in range(2))
    expected_sum, residual_before = x + residual, residual.clone()
    with torch.inference_mode():
        normed, summed = norm(x, residual)
    assert summed is x and torch.equal(x, expected_sum)
    assert torch.equal(residual, residual_before)
    expected = hf_rms_norm(expected_sum, norm.weight.detach(), norm.eps)
    torch.testing.assert_close(normed, expected, atol=1e-6, rtol=1e-6)


def test_the_norm_without_a_residual_leaves_x_and_returns_it_as_the_stream():
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(4))
    before, norm = x.clone(), seeded_norm(96)
    with torch.inference_mode():
        normed, stream = norm(x)
    assert stream is x and torch.equal(x, before)
    torch.testing.assert_close(normed, hf_rms_norm(x, norm.weight.detach(), norm.eps))


def test_the_fused_norm_agrees_with_the_torch_norm_of_bfloat16_inputs_cast_back():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(5)).bfloat16()
    norm = seeded_norm(64)
    with torch.inference_mode():
        fused, _ = norm(x.float())
        via_torch, _ = norm.bfloat16()(x)
    assert via_torch.dtype == torch.bfloat16
    torch.testing.assert_close(via_torch.float(), fused, atol=0.02, rtol=0.02)


def test_the_fused_norm_scales_by_the_weight_it_holds_now():
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(6))
    norm = seeded_norm(16)
    unit_scaled = hf_rms_norm(x, torch.ones(16), norm.eps)
    with torch.inference_mode():
        norm(x.clone())  # the weight's numpy view is made and kept
        norm.load_state_dict({"weight": torch.full((16,), 2.0)})  # copied into the same memory
        after_load, _ = norm(x.clone())
        norm.weight = torch.nn.Parameter(torch.full((16,), 3.0))  # a new Parameter
        after_new_parameter, _ = norm(x.clone())
        norm.weight.data = torch.full((16,), 5.0)  # new memory under the same Parameter
        after_new_data, _ = norm(x.clone())
    for normed, scale in ((after_load, 2), (after_new_parameter, 3), (after_new_data, 5)):
        torch.testing.assert_close(normed, unit_scaled * scale)


def test_silu_and_mul_is_within_three_ulp_of_the_exact_product_over_the_whole_range():
    generator = torch.Generator().manual_seed(0)
    gate = torch.cat(
        (torch.randn(4, 600, generator=generator) * 8, torch.linspace(-90, 90, 2400).view(4, 600)),
        1,
    )
    up = torch.randn(4, 1200, generator=generator)
    out = silu_and_mul(torch.cat((gate, up), dim=1))
    exact = F.silu(gate.double()) * up.double()
    assert out.shape == (4, 1200) and out.dtype == torch.float32
    # below -87 e**x is under float32's smallest normal: the kernel gives 0 where the exact is tiny
    torch.testing.assert_close(out.double(), exact, rtol=3 * 2**-23, atol=1e-35)


def test_silu_and_mul_keeps_nan_and_infinities_as_torch_does():
    gate = torch.tensor([[float("nan"), float("inf"), -float("inf"), 0.0]])
    up = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    out = silu_and_mul(torch.cat((gate, up), dim=1))
    torch.testing.assert_close(out, F.silu(gate) * up, equal_nan=True)  # NaN, inf, NaN, 0


def test_silu_and_mul_in_bfloat16_is_torchs_silu_times_up():
    gate_up = torch.randn(3, 16, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    gate, up = gate_up.chunk(2, dim=1)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate) * up)


def test_only_float32_on_a_cpu_fuses():
    assert fuses_on_cpu(torch.zeros(2, 3))
    assert not fuses_on_cpu(torch.zeros(2, 3, dtype=torch.bfloat16))
    assert not fuses_on_cpu(torch.zeros(2, 3, device="meta"))
