"""CUDA checks (marker ``gpu``; skipped without CUDA): model parity and a back-to-back run on the
GPU."""

import math

import pytest
import torch
import transformers

from batchgen.model.llama import SeqInput
from batchgen.model.loader import load_model
from batchgen.model.paged_kv import kv_page_shape, write_kv
from batchgen.validation.validate import validate_back_to_back

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.fixture(autouse=True)
def exact_matmul():
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity needs true fp32 matmuls
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous


@pytest.mark.parametrize("num_kv_heads, page_size, prompt_len", [(4, 16, 37), (1, 5, 1500)])
def test_paged_model_on_cuda_matches_hf_on_cuda(tmp_path, num_kv_heads, page_size, prompt_len):
    config = transformers.LlamaConfig(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    hf = hf.cuda()
    model = load_model(str(tmp_path), device="cuda")
    prompt = torch.randint(101, (prompt_len,), generator=torch.Generator().manual_seed(1)).tolist()
    num_pages = math.ceil((prompt_len + 8) / page_size)
    pages = torch.full(kv_page_shape(model.config, page_size, num_pages), math.nan, device="cuda")
    page_ids, ids, start, tokens = list(range(num_pages))[::-1], list(prompt), 0, []
    for _ in range(8):
        out = model([SeqInput(ids, start, page_ids)], pages)
        with torch.no_grad():
            expected = hf(torch.tensor([prompt + tokens], device="cuda")).logits[0, -1].float()
        torch.testing.assert_close(out.logits[0], expected, atol=1e-4, rtol=1e-4)
        write_kv(pages, page_ids, start, out.new_kv[0])
        start += len(ids)
        ids = [int(out.logits[0].argmax())]
        tokens.append(ids[0])


def test_back_to_back_validation_passes_on_cuda():
    report = validate_back_to_back(load_model("tiny", device="cuda"), device="cuda")
    assert report.ok, report.failures
