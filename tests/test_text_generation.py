"""Text through a checkpoint's own tokenizer: the tiny checkpoint against HF transformers, the chat
template, stop strings, EOS from generation_config.json, n samples and seeds, via batchgen.LLM."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from batchgen import LLM, Sampling
from batchgen.cli import main
from batchgen.engine.request_checks import RequestError
from batchgen.model.loader import load_model
from batchgen.text.detokenize import StopStringWatch
from batchgen.text.tiny_checkpoint import make_checkpoint, train_tokenizer
from batchgen.text.tokenizer import TextTokenizer, TokenizerError

PROMPTS = ["Once upon a time", "The cache keeps pages", "Hello! How are you"]
GREEDY = Sampling(max_tokens=10, temperature=0.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, gpu_pages=64, host_pages=8, page_size=16)


def test_greedy_text_and_chat_equal_hf_transformers_generate_with_the_same_tokenizer(
    checkpoint, llm
):
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint).eval()

    ours = llm.generate(PROMPTS, GREEDY)

    for prompt, result in zip(PROMPTS, ours):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        hf = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
        new = hf[0, ids.shape[1] :].tolist()
        assert result.prompt_ids == tuple(ids[0].tolist())
        assert result.completions[0].token_ids == tuple(new)
        assert result.completions[0].text == tokenizer.decode(new, skip_special_tokens=True)

    messages = [{"role": "user", "content": "Hello! How are you?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    hf = model.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)
    reply = llm.chat([messages], GREEDY)[0]
    assert reply.prompt_ids == tuple(ids[0].tolist())
    assert reply.completions[0].token_ids == tuple(hf[0, ids.shape[1] :].tolist())


def test_the_chat_template_renders_as_transformers_renders_it(checkpoint, llm):
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    hf = transformers.AutoTokenizer.from_pretrained(checkpoint)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert llm.tokenizer.render_chat(messages) == expected
    assert expected == "<s><|system|>Be brief.</s><|user|>Hi</s><|assistant|>"


def test_a_stop_string_ends_the_text_just_before_it(llm):
    full = llm.generate(PROMPTS[0], Sampling(max_tokens=10, temperature=0.0))[0].completions[0]
    stop = full.text[5:8]  # three characters from the middle of the greedy text
    cut = llm.generate(PROMPTS[0], Sampling(max_tokens=10, temperature=0.0, stop=(stop,)))
    completion = cut[0].completions[0]
    assert completion.finish_reason == "stop"
    assert completion.text == full.text[: full.text.index(stop)]
    assert full.token_ids[: len(completion.token_ids)] == completion.token_ids
    assert len(completion.token_ids) < len(full.token_ids)


def test_a_stop_string_split_across_tokens_is_found():
    tokenizer = train_tokenizer(512)
    ids = tokenizer.encode("the sea shore", add_special_tokens=False).ids
    watch = StopStringWatch(tokenizer, ("a sh",))
    assert [watch.feed([token]) for token in ids][-1] is True
    assert watch.text == "the se"


def test_eos_from_generation_config_ends_the_completion(checkpoint, llm, tmp_path):
    greedy = llm.generate(PROMPTS[1], GREEDY)[0].completions[0]
    eos = greedy.token_ids[3]
    copy = tmp_path / "eos-ckpt"
    shutil.copytree(checkpoint, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    other = LLM(copy, gpu_pages=64, host_pages=8)

    ended = other.generate(PROMPTS[1], GREEDY)[0].completions[0]
    ignoring = other.generate(PROMPTS[1], Sampling(max_tokens=10, temperature=0.0, ignore_eos=True))

    assert (ended.token_ids, ended.finish_reason) == (greedy.token_ids[:4], "stop")
    assert ended.text == other.tokenizer.decode(greedy.token_ids[:4])
    assert ignoring[0].completions[0].token_ids == greedy.token_ids


def test_n_samples_draw_their_own_streams_and_a_seed_repeats_them(llm):
    sampling = Sampling(n=3, max_tokens=8, temperature=1.0, seed=7)
    first = llm.generate(PROMPTS, sampling)
    again = llm.generate(list(reversed(PROMPTS)), sampling)  # another order: other keys
    repeat = llm.generate(PROMPTS, sampling)
    one = llm.generate(PROMPTS, Sampling(max_tokens=8, temperature=1.0, seed=7))

    tokens = [[c.token_ids for c in r.completions] for r in first]
    assert all(len(set(samples)) == 3 for samples in tokens)
    assert [[c.token_ids for c in r.completions] for r in repeat] == tokens
    assert [r.completions[0].token_ids for r in one] == [samples[0] for samples in tokens]
    # prompt 0 of the reversed call is PROMPTS[2] under key "0": the key, not the text, seeds it
    assert again[0].completions[0].token_ids != tokens[2][0]


def test_logprobs_come_with_each_token_when_asked(llm):
    result = llm.generate(PROMPTS[0], Sampling(max_tokens=4, temperature=0.0, logprobs=3))
    completion = result[0].completions[0]
    assert len(completion.logprobs) == 4
    for token, lp in zip(completion.token_ids, completion.logprobs):
        assert len(lp.top) == 3 and lp.top[0][0] == token and lp.token_logprob == lp.top[0][1]
    assert llm.generate(PROMPTS[0], GREEDY)[0].completions[0].logprobs is None


def test_a_prompt_the_engine_refuses_fails_the_call_before_any_runs(llm):
    with pytest.raises(RequestError, match=r"sampling\.top_p=0; must be a number in \(0, 1\]"):
        llm.generate(PROMPTS, Sampling(top_p=0))
    assert not llm.worker.state.requests


def test_a_directory_without_tokenizer_json_is_refused_naming_the_file(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing"):
        TextTokenizer(tmp_path)


def test_the_llm_example_in_the_docs_runs(checkpoint, tmp_path, monkeypatch, capsys):
    doc = (Path(__file__).parents[1] / "docs" / "generate.md").read_text()
    code = doc.split("```python\n", 1)[1].split("```", 1)[0]
    shutil.copytree(checkpoint, tmp_path / "tiny-ckpt")
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(code, "docs/generate.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 2 and all(line.endswith(" length") for line in printed)
    assert [len(r.completions) for r in namespace["replies"]] == [2]


def test_make_checkpoint_writes_the_seeded_tiny_model_with_its_tokenizer(tmp_path, capsys):
    assert main(["make-checkpoint", str(tmp_path / "ckpt"), "--seed", "4"]) == 0
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    loaded, seeded = load_model(str(tmp_path / "ckpt")), load_model("tiny", seed=4)
    assert loaded.config == seeded.config.model_copy(update={"eos_token_ids": (1,)})
    state = loaded.state_dict()
    assert all(torch.equal(state[name], value) for name, value in seeded.state_dict().items())
    assert TextTokenizer(tmp_path / "ckpt").vocab_size == loaded.config.vocab_size


def test_top_k_1_and_a_tiny_top_p_sample_exactly_the_greedy_text(llm):
    greedy = [r.completions[0] for r in llm.generate(PROMPTS, GREEDY)]
    for masks in ({"top_k": 1}, {"top_p": 1e-9}):
        hot = Sampling(max_tokens=10, temperature=1.5, seed=5, **masks)
        assert [r.completions[0] for r in llm.generate(PROMPTS, hot)] == greedy
    free = [r.completions[0] for r in llm.generate(PROMPTS, Sampling(max_tokens=10, seed=5))]
    assert free != greedy  # without a mask, temperature 1 departs from greedy
