"""The real model, SmolLM2-135M-Instruct, as users bring it: the GGUF file as shipped and the HF
directory transformers makes of it. Greedy tokens equal HF transformers' through both; compare
mode under KV pressure; validate's real-model pass catches a K/V layout bug in the bfloat16 K/V
write. Under CI the model must be fetchable; elsewhere these tests skip without it."""

import json

import numpy as np
import pytest
import torch

from batchgen import LLM, Sampling
from batchgen.cli import main
from batchgen.model import kv_write_kernel
from batchgen.validation import real_model_check
from batchgen.validation.real_model_check import check_real_model, real_failures, run_real_workload

transformers = pytest.importorskip("transformers")

CHATS = ["What is the capital of France?", "Name two planets of the solar system."]
TEXTS = ["The three primary colors are", "def add(a, b):\n"]
NUM_TOKENS = 16
GREEDY = Sampling(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(real_model_hf_dir):
    tokenizer = transformers.AutoTokenizer.from_pretrained(real_model_hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        real_model_hf_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return tokenizer, model.eval()


def hf_greedy(model, ids: list[int]) -> tuple[int, ...]:
    input_ids = torch.tensor([ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=NUM_TOKENS,
        min_new_tokens=NUM_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return tuple(out[0, len(ids) :].tolist())


def hf_chat_ids(tokenizer, content: str) -> list[int]:
    messages = [{"role": "user", "content": content}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("source", ["hf_dir", "gguf"])
def test_greedy_chat_and_completion_tokens_equal_hf_transformers(
    source, real_model_hf_dir, real_model_gguf, hf
):
    tokenizer, model = hf
    llm = LLM(real_model_hf_dir if source == "hf_dir" else real_model_gguf, kv_cache_gib=0.25)
    chats = llm.chat([[{"role": "user", "content": c}] for c in CHATS], GREEDY)
    for content, result in zip(CHATS, chats):
        ids = hf_chat_ids(tokenizer, content)
        assert result.prompt_ids == tuple(ids)
        assert result.completions[0].token_ids == hf_greedy(model, ids)
    for text, result in zip(TEXTS, llm.generate(TEXTS, GREEDY)):
        ids = tokenizer(text).input_ids
        assert result.prompt_ids == tuple(ids)
        assert result.completions[0].token_ids == hf_greedy(model, ids)


def test_compare_mode_under_kv_pressure_has_no_divergence_and_the_roomy_runs_tokens(
    real_model_gguf,
):
    llm = LLM(real_model_gguf, kv_cache_gib=0.25)
    runs = run_real_workload(llm.worker.model, llm.tokenizer, "cpu")
    stats = runs.pressured.stats
    assert (stats.evictions, stats.loads, stats.recompute_preemptions) == (6, 6, 2)
    # the two later chats take the system prompt's first page from the cache
    assert (stats.prefix_cache_hits, runs.roomy.stats.prefix_cache_hits) == (32, 0)
    assert sum(runs.pressured.compare_summary.divergences.values()) == 0
    assert sum(runs.pressured.compare_summary.steps_compared.values()) > 0
    assert real_failures(runs, tolerance=1e-4) == []


def test_generate_answers_a_chat_line_from_the_gguf_file_under_its_stem(
    real_model_gguf, tmp_path, capsys
):
    body = {"messages": [{"role": "user", "content": CHATS[0]}], "temperature": 0}
    line = {"custom_id": "q", "method": "POST", "url": "/v1/chat/completions", "body": body}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    argv = ["generate", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    assert main([*argv, "--model", str(real_model_gguf), "--kv-cache-gib", "0.25", "--json"]) == 0
    reply = json.loads((tmp_path / "out.jsonl").read_text())["response"]["body"]
    assert reply["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert reply["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert json.loads(capsys.readouterr().out)["lines_done"] == 1


def test_the_bfloat16_pass_catches_k_and_v_swapped_in_the_kv_write(
    real_model_gguf, real_model_hf_dir, monkeypatch
):
    # bfloat16 pages on a CPU are written by the kernel, as their int16 bits (paged_kv.write_kvs)
    write = kv_write_kernel.write_runs

    def swapped(kv_pages, new_kvs, *args):
        write(kv_pages, np.ascontiguousarray(new_kvs[:, ::-1]), *args)  # axis 1 holds K, V

    monkeypatch.setattr(kv_write_kernel, "write_runs", swapped)
    monkeypatch.setattr(real_model_check, "CHATS", real_model_check.CHATS[:1])
    monkeypatch.setattr(real_model_check, "COMPLETIONS", ())
    verdict = check_real_model("cpu", "bfloat16")
    assert verdict.failures
    assert all("HF transformers'" in f or "real-0" in f for f in verdict.failures)
