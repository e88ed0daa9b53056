"""The paged decoder against HF transformers: checkpoints saved by HF, logits and greedy tokens
compared."""

import math

import pytest
import torch

from batchgen.model import paged_attention
from batchgen.model.llama import SeqInput
from batchgen.model.loader import load_model
from batchgen.model.paged_attention import Span
from batchgen.model.paged_kv import gather_kv, kv_page_shape, write_kv
from batchgen.validation.hf_oracle import save_hf_model

SMALL_GEOMETRY = dict(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
NUM_DECODE_STEPS = 8


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """HF logits [len(token_ids), vocab] of one full forward, float32."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def random_tokens(num_tokens: int, vocab_size: int, seed: int) -> list[int]:
    return torch.randint(
        vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def make_pages(
    model, page_size: int, num_pages: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Pages filled with NaN: reading a slot nobody wrote poisons the logits."""
    return torch.full(kv_page_shape(model.config, page_size, num_pages), math.nan, dtype=dtype)


def generate_paged(model, prompt: list[int], *, page_size: int, pages_dtype=torch.float32):
    """Greedy prefill + NUM_DECODE_STEPS decodes through a real page tensor; returns (logits per
    step, tokens)."""
    num_needed = math.ceil((len(prompt) + NUM_DECODE_STEPS) / page_size)
    num_pages = num_needed + 3
    page_ids = torch.randperm(num_pages, generator=torch.Generator().manual_seed(1))[
        :num_needed
    ].tolist()
    pages = make_pages(model, page_size, num_pages, pages_dtype)
    step_logits, tokens, new_ids, start_pos = [], [], list(prompt), 0
    for _ in range(NUM_DECODE_STEPS + 1):
        out = model([SeqInput(new_ids, start_pos, page_ids)], pages)
        write_kv(pages, page_ids, start_pos, out.new_kv[0])
        start_pos += len(new_ids)
        new_ids = [int(out.logits[0].argmax())]
        step_logits.append(out.logits[0])
        tokens.append(new_ids[0])
    return torch.stack(step_logits), tokens


PARITY_CASES = {
    "llama-mha-page5-prompt3-sharded": dict(
        arch="llama",
        page_size=5,
        prompt_len=3,
        max_shard_size="8KB",
        geometry=dict(SMALL_GEOMETRY, num_key_value_heads=4),
    ),
    "llama-gqa4-headdim8-theta5000-page16-prompt37": dict(
        arch="llama",
        page_size=16,
        prompt_len=37,
        geometry=dict(SMALL_GEOMETRY, num_attention_heads=8, head_dim=8, rope_theta=5000.0),
    ),
    "llama-gqa4-page16-prompt1999": dict(
        arch="llama",
        page_size=16,
        prompt_len=1999,
        geometry=dict(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=2048,
        ),
    ),
    "qwen2-bias-page5-prompt21": dict(
        arch="qwen2", page_size=5, prompt_len=21, geometry=SMALL_GEOMETRY
    ),
    "llama-tied-page16-prompt10": dict(
        arch="llama",
        page_size=16,
        prompt_len=10,
        geometry=dict(SMALL_GEOMETRY, tie_word_embeddings=True),
    ),
}


@pytest.fixture(params=["in place", "padded"])
def decode_path(request, monkeypatch) -> str:
    """Each decode attention on CPU: the kernel reading pages in place (float32 pages on a CPU),
    and the padded SDPA batches every other device runs."""
    if request.param == "padded":
        monkeypatch.setattr(paged_attention, "attends_in_place", lambda kv_pages: False)
    return request.param


@pytest.mark.parametrize("case", PARITY_CASES.values(), ids=PARITY_CASES.keys())
def test_prefill_and_greedy_decode_match_hf(tmp_path, case, decode_path):
    geometry = case["geometry"]
    hf_model = save_hf_model(
        tmp_path, case["arch"], seed=3, max_shard_size=case.get("max_shard_size"), **geometry
    )
    if case.get("max_shard_size"):
        assert (tmp_path / "model.safetensors.index.json").is_file()
    model = load_model(str(tmp_path))
    prompt = random_tokens(case["prompt_len"], geometry["vocab_size"], seed=5)

    step_logits, tokens = generate_paged(model, prompt, page_size=case["page_size"])

    expected = hf_logits(hf_model, prompt + tokens[:-1])[len(prompt) - 1 :]
    torch.testing.assert_close(step_logits, expected, atol=1e-4, rtol=0)
    assert expected.argmax(-1).tolist() == tokens


def test_bfloat16_tracks_hf_in_bfloat16(tmp_path):
    hf_model = save_hf_model(tmp_path, seed=4, **SMALL_GEOMETRY).to(torch.bfloat16)
    model = load_model(str(tmp_path), dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    prompt = random_tokens(30, SMALL_GEOMETRY["vocab_size"], seed=6)

    step_logits, tokens = generate_paged(model, prompt, page_size=16, pages_dtype=torch.bfloat16)

    expected = hf_logits(hf_model, prompt + tokens[:-1])[len(prompt) - 1 :]
    assert step_logits.dtype == torch.float32
    torch.testing.assert_close(step_logits, expected, atol=0.1, rtol=0.02)


def test_new_kv_has_the_contract_shape_and_page_dtype(tmp_path):
    save_hf_model(tmp_path, seed=0, **SMALL_GEOMETRY)
    model = load_model(str(tmp_path))
    pages = make_pages(model, page_size=5, num_pages=4, dtype=torch.bfloat16)
    out = model([SeqInput([1, 2, 3, 4, 5, 6, 7], 0, [2, 0]), SeqInput([9], 0, [3])], pages)
    assert (
        out.logits.shape == (2, SMALL_GEOMETRY["vocab_size"]) and out.logits.dtype == torch.float32
    )
    assert [kv.shape for kv in out.new_kv] == [(2, 2, 7, 2, 8), (2, 2, 1, 2, 8)]
    assert {kv.dtype for kv in out.new_kv} == {torch.bfloat16}


@pytest.fixture
def small_model(tmp_path):
    hf_model = save_hf_model(tmp_path, seed=7, **SMALL_GEOMETRY)
    return hf_model, load_model(str(tmp_path))


def prefill_into_pages(model, pages, token_ids: list[int], page_ids: list[int]) -> None:
    """Run a sequence alone and write its K/V; mutates pages."""
    write_kv(pages, page_ids, 0, model([SeqInput(token_ids, 0, page_ids)], pages).new_kv[0])


def test_mixed_batch_matches_each_sequence_alone_and_hf(small_model, decode_path):
    hf_model, model = small_model
    pages = make_pages(model, page_size=5, num_pages=40)
    vocab = SMALL_GEOMETRY["vocab_size"]
    histories = {
        name: random_tokens(n, vocab, seed=n)
        for name, n in [("a", 4), ("b", 11), ("c", 23), ("e", 6)]
    }
    page_tables = {
        "a": [0, 9],
        "b": [3, 1, 7],
        "c": [20, 2, 4, 6, 8],
        "d": [10, 11],
        "e": [30, 12, 31],
    }
    for name, history in histories.items():
        prefill_into_pages(model, pages, history, page_tables[name])
    new_tokens = {
        "a": [5],
        "b": [17],
        "c": [42],
        "d": random_tokens(9, vocab, seed=9),
        "e": [1, 2, 3, 4, 5],
    }
    batch = [
        SeqInput(new_tokens["a"], 4, page_tables["a"]),  # decode
        SeqInput(new_tokens["d"], 0, page_tables["d"]),  # prefill
        SeqInput(new_tokens["b"], 11, page_tables["b"]),  # decode
        # extend: cached history and several new tokens
        SeqInput(new_tokens["e"], 6, page_tables["e"]),
        SeqInput(new_tokens["c"], 23, page_tables["c"]),  # decode
    ]

    batched = model(batch, pages)

    for index, (seq, name) in enumerate(zip(batch, "adbec")):
        alone = model([seq], pages)
        torch.testing.assert_close(batched.logits[index], alone.logits[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(batched.new_kv[index], alone.new_kv[0], atol=1e-5, rtol=0)
        full_sequence = histories.get(name, []) + new_tokens[name]
        torch.testing.assert_close(
            batched.logits[index], hf_logits(hf_model, full_sequence)[-1], atol=1e-4, rtol=0
        )


def test_extend_new_kv_equals_prefill_kv_at_the_same_positions(small_model):
    _, model = small_model
    pages = make_pages(model, page_size=5, num_pages=8)
    tokens = random_tokens(17, SMALL_GEOMETRY["vocab_size"], seed=2)
    prefill_into_pages(model, pages, tokens[:10], [5, 1])

    extend_kv = model([SeqInput(tokens[10:], 10, [5, 1, 6, 2])], pages).new_kv[0]
    full_kv = model([SeqInput(tokens, 0, [5, 1, 6, 2])], pages).new_kv[0]

    torch.testing.assert_close(extend_kv, full_kv[:, :, 10:], atol=1e-5, rtol=0)


def test_forward_does_not_write_pages(small_model):
    _, model = small_model
    pages = torch.zeros(kv_page_shape(model.config, 4, 6))
    prefill_into_pages(model, pages, [1, 2, 3, 4, 5], [4, 2])
    before = pages.clone()
    model(
        [SeqInput([6], 5, [4, 2]), SeqInput([7, 8], 5, [4, 2, 1]), SeqInput([9, 9, 9], 0, [3])],
        pages,
    )
    assert torch.equal(pages, before)
    assert torch.equal(gather_kv(pages, [3], 3, layer=0)[0], torch.zeros(3, 2, 8))


def test_invalid_batches_are_rejected(small_model):
    _, model = small_model
    pages = make_pages(model, page_size=4, num_pages=3)
    with pytest.raises(ValueError, match="at least one sequence"):
        model([], pages)
    with pytest.raises(ValueError, match="sequence 1 has no new tokens"):
        model([SeqInput([1], 0, [0]), SeqInput([], 3, [1])], pages)
    with pytest.raises(
        ValueError, match=r"sequence 0: 1 pages of 4 do not cover positions \[0, 5\)"
    ):
        model([SeqInput([1], 4, [0])], pages)


def test_decode_reads_no_slot_past_its_context(small_model, decode_path):
    _, model = small_model
    pages = make_pages(model, page_size=4, num_pages=12)  # NaN wherever nothing was written
    history = random_tokens(9, SMALL_GEOMETRY["vocab_size"], seed=4)
    prefill_into_pages(model, pages, history, [6, 2, 9])
    prefill_into_pages(model, pages, history[:5], [8, 10])
    prefill_into_pages(model, pages, history[:2], [4])
    # padded to three pages: with zeros (one page, not full), with its own full first page
    short, middle = SeqInput([7], 2, [4]), SeqInput([7], 5, [8, 10])
    # pages past the context (unwritten, NaN) change nothing
    long, with_spare_pages = SeqInput([7], 9, [6, 2, 9]), SeqInput([7], 9, [6, 2, 9, 3, 0])

    batched = model([short, middle, with_spare_pages], pages)

    for row, alone in enumerate((short, middle, long)):
        expected = model([alone], pages).logits[0]
        torch.testing.assert_close(batched.logits[row], expected, atol=1e-5, rtol=0)
    assert not batched.logits.isnan().any()


def test_padded_decodes_of_unequal_lengths_attend_in_batches_as_each_alone(
    small_model, monkeypatch
):
    monkeypatch.setattr(paged_attention, "attends_in_place", lambda kv_pages: False)
    _, model = small_model
    pages = make_pages(model, page_size=2, num_pages=40)
    vocab = SMALL_GEOMETRY["vocab_size"]
    long_table, short_tables = list(range(20, 40)), [[0, 1], [2, 3], [4, 5]]
    prefill_into_pages(model, pages, random_tokens(39, vocab, seed=1), long_table)
    for seed, table in enumerate(short_tables):
        prefill_into_pages(model, pages, random_tokens(3, vocab, seed=seed), table)
    batch = [SeqInput([7], 3, short_tables[0]), SeqInput([8], 39, long_table)]
    batch += [SeqInput([9], 3, table) for table in short_tables[1:]]
    spans = [Span(row, 1, seq.start_pos, seq.page_ids) for row, seq in enumerate(batch)]
    # a page of one layer's K and V holds 2 x 2 x 2 x 8 floats (256 bytes); at a batch cost of 40
    # pages, the three short rows padded to the long one's 20 pages would waste 54: they are cut
    with monkeypatch.context() as patch:
        patch.setattr(paged_attention, "DECODE_BATCH_COST_BYTES", 256 * 40)
        plan = paged_attention.plan_attention(spans, pages)
    assert [decodes.rows.tolist() for decodes in plan.decodes] == [[1], [0, 2, 3]]

    batched = model(batch, pages)

    for row, seq in enumerate(batch):
        expected = model([seq], pages).logits[0]
        torch.testing.assert_close(batched.logits[row], expected, atol=1e-5, rtol=0)
