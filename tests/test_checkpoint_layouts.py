"""Checkpoints as today's transformers saves them: the chat template in chat_template.jinja (which
wins over tokenizer_config.json's field), generation_config.json's sampling defaults read as
vLLM's --generation-config reads them, EOS ids of both configs; CPU pool sizes from the KV
budget; --max-model-len; generate's summary."""

import json
import shutil

import pytest

from batchgen import LLM
from batchgen.cli import main
from batchgen.config import TINY_MODELS
from batchgen.entrypoints.pool_sizes import cache_config, page_bytes
from batchgen.model.loader import ModelLoadError, load_model
from batchgen.openai.request_body import parse_body, sampling_of
from batchgen.text.generation_defaults import GenerationConfigError, read_generation_defaults
from batchgen.text.tiny_checkpoint import make_checkpoint
from batchgen.text.tokenizer import TextTokenizer, TokenizerError

JINJA = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
HELLO = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-ckpt")


@pytest.fixture
def copy(checkpoint, tmp_path):
    return shutil.copytree(checkpoint, tmp_path / "copy")


def write_json(path, data) -> None:
    path.write_text(json.dumps(data))


def test_chat_template_jinja_wins_over_the_tokenizer_config_field(copy):
    (copy / "chat_template.jinja").write_text(JINJA)
    assert TextTokenizer(copy).render_chat(HELLO) == "[user] Hi\n[assistant]"


def test_chat_template_jinja_alone_serves_chat(copy):
    config = json.loads((copy / "tokenizer_config.json").read_text())
    del config["chat_template"]
    write_json(copy / "tokenizer_config.json", config)
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: no chat template \(nor a"):
        TextTokenizer(copy).render_chat(HELLO)
    (copy / "chat_template.jinja").write_text(JINJA)
    assert TextTokenizer(copy).render_chat(HELLO) == "[user] Hi\n[assistant]"


def test_a_broken_template_file_is_named_in_the_error(copy):
    (copy / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja: the chat template is not"):
        TextTokenizer(copy)


def test_eos_ids_are_those_of_both_configs_together(copy):
    config = json.loads((copy / "config.json").read_text())
    write_json(copy / "config.json", {**config, "eos_token_id": [7, 1]})
    write_json(copy / "generation_config.json", {"eos_token_id": [1, 9]})
    assert TextTokenizer(copy).eos_token_ids == (7, 1, 9)


def defaults_of(copy, data: dict, setting="auto"):
    write_json(copy / "generation_config.json", data)
    return read_generation_defaults(copy, setting)


def test_generation_config_sets_the_defaults_of_a_line_that_sets_none(copy):
    defaults = defaults_of(copy, {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05})
    unset = parse_body("/v1/completions", {"prompt": "x"}, "m")
    assert sampling_of(unset, 3, defaults).temperature == 0.6
    sampling = sampling_of(unset, 3, defaults)
    assert (sampling.top_p, sampling.top_k, sampling.min_p) == (0.9, 20, 0.05)
    own = parse_body("/v1/completions", {"prompt": "x", "temperature": 0, "top_k": 0}, "m")
    sampling = sampling_of(own, 3, defaults)
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.0, 0, 0.9)


def test_max_new_tokens_caps_every_line(copy):
    defaults = defaults_of(copy, {"max_new_tokens": 12})
    for body, expected in (({}, 12), ({"max_tokens": 5}, 5), ({"max_tokens": 50}, 12)):
        chat = parse_body("/v1/chat/completions", {"messages": HELLO, **body}, "m")
        assert sampling_of(chat, 0, defaults).max_tokens == expected
    completion = parse_body("/v1/completions", {"prompt": "x"}, "m")  # OpenAI's default: 16
    assert sampling_of(completion, 0, defaults).max_tokens == 12


def test_values_equal_to_transformers_defaults_are_not_defaults_as_in_vllm(copy):
    defaults = defaults_of(copy, {"temperature": 1.0, "top_k": 50, "top_p": 0.8})
    assert defaults.sampling == {"top_p": 0.8}


def test_the_vllm_setting_ignores_the_file_and_a_directory_setting_reads_its_own(copy, tmp_path):
    assert defaults_of(copy, {"temperature": 0.2}, "vllm").sampling == {}
    other = tmp_path / "other"
    other.mkdir()
    write_json(other / "generation_config.json", {"top_k": 3})
    assert read_generation_defaults(copy, str(other)).sampling == {"top_k": 3}
    with pytest.raises(GenerationConfigError, match="not a directory; allowed: auto, vllm, or"):
        read_generation_defaults(copy, str(tmp_path / "missing"))


def test_fields_batchgen_cannot_apply_are_named_in_one_warning(copy):
    defaults = defaults_of(copy, {"repetition_penalty": 1.1, "num_beams": 1, "typical_p": 0.5})
    assert defaults.ignored == ("repetition_penalty", "typical_p")
    assert defaults.warning().endswith(
        "generation_config.json: repetition_penalty, typical_p not applied (batchgen samples with"
        " temperature, top_p, top_k, min_p and max_new_tokens)"
    )


def test_a_bad_generation_config_stops_generate_naming_the_file(copy, tmp_path, capsys):
    write_json(copy / "generation_config.json", {"temperature": -1})
    (tmp_path / "in.jsonl").write_text("")
    argv = ["generate", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    assert main([*argv, "--model", str(copy)]) == 2
    assert "generation_config.json: temperature -1 is outside [0.0, inf]" in capsys.readouterr().err


def test_llm_samples_with_the_generation_config_defaults(copy):
    write_json(copy / "generation_config.json", {"temperature": 0.0, "max_new_tokens": 3})
    llm = LLM(copy, gpu_pages=64, host_pages=8)
    assert llm.default_sampling(max_tokens=16).temperature == 0.0
    completion = llm.generate("Once upon a time")[0].completions[0]
    assert len(completion.token_ids) == 3
    greedy = LLM(copy, gpu_pages=64, host_pages=8, generation_config="vllm")
    assert greedy.default_sampling(max_tokens=None).temperature == 1.0


def test_cpu_pools_share_the_kv_budget_four_to_one():
    model = TINY_MODELS["tiny"]
    budget_pages = 2**30 // page_bytes(model, 16, "float32")
    cache = cache_config(model, device="cpu", dtype="float32", kv_cache_gib=1.0, max_num_seqs=999)
    assert cache.num_gpu_pages == budget_pages * 4 // 5
    assert cache.num_host_pages == cache.num_gpu_pages // 4


def test_cpu_pools_hold_at_most_max_num_seqs_contexts():
    model = TINY_MODELS["tiny"].model_copy(update={"max_context": 256})  # 16 pages a context
    cache = cache_config(model, device="cpu", dtype="float32", max_num_seqs=5)
    assert (cache.num_gpu_pages, cache.num_host_pages) == (5 * 16, 20)


def test_max_model_len_cuts_the_context_and_refuses_more_than_the_model_has():
    assert load_model("tiny", max_model_len=100).config.max_context == 100
    with pytest.raises(ModelLoadError, match=r"--max-model-len 99999: tiny has a context of"):
        load_model("tiny", max_model_len=99999)


def test_generate_summary_keeps_start_up_and_generation_apart(checkpoint, tmp_path, capsys):
    line = {"custom_id": "a", "method": "POST", "url": "/v1/completions"}
    (tmp_path / "in.jsonl").write_text(json.dumps({**line, "body": {"prompt": "Hi"}}) + "\n")
    argv = ["generate", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "out.jsonl")]
    assert main([*argv, "--model", str(checkpoint), "--kv-cache-gib", "0.25", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["end_to_end_s"] == pytest.approx(summary["startup_s"] + summary["wall_s"])
    assert summary["startup_s"] > 0 and summary["tokens_generated"] == 16
    assert (summary["loads"], summary["recompute_preemptions"]) == (0, 0)
    expected = cache_config(
        load_model(str(checkpoint)).config, device="cpu", dtype="float32", kv_cache_gib=0.25
    )
    assert (summary["gpu_pages"], summary["host_pages"]) == (
        expected.num_gpu_pages,
        expected.num_host_pages,
    )
