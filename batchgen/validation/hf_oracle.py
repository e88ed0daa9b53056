"""An oracle for the model's own K/V layout: the tiny model's greedy tokens on one short workload,
run by the engine under KV pressure (pages evicted to host and loaded back), against HF
transformers on the same checkpoint.

Both KV paths and the pressure-free reference share the model and the page layout, so a bug in
how K/V are laid out in pages, or in the attention that reads them, is invisible to "tokens
equal the reference"; HF's own attention and cache are not. The checkpoint is the tiny model's
geometry with weights drawn so that logits are of order 1 and attention is sharp (``randomise_``,
as the parity tests draw theirs): the seeded tiny model's near-uniform attention would hide a
bug on the key side. It is saved in HF format, and each engine loads it with its own loader, on
validate's device and dtype. Tokens must be equal, or differ first at a near-tie (the engine's top
two log-probabilities there within the dtype's tolerance). Needs ``transformers`` (a dev extra):
without it the oracle says so in one line and fails nothing.
"""

from __future__ import annotations

import importlib.util
import math
import random
import tempfile
from dataclasses import dataclass

import torch

from batchgen.config import TINY_MODELS, CacheConfig, EngineConfig
from batchgen.engine.runner import run_workload
from batchgen.engine.worker import Worker
from batchgen.engine.workloads import Workload, WorkloadRequest
from batchgen.model.loader import SUPPORTED_DTYPES, load_model
from batchgen.state import RequestOutput

# architecture -> transformers' (config class, model class); a model with q/k/v biases is Qwen2's
HF_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}
NUM_REQUESTS, NUM_NEW_TOKENS = 4, 12
ORACLE_SEED = 11  # the oracle checkpoint's weights


@dataclass(frozen=True)
class OracleVerdict:
    """What the oracle said: one line for the summary, and the failures (empty: it agreed)."""

    line: str
    failures: tuple[str, ...] = ()


def hf_classes(arch: str) -> tuple[type, type]:
    """transformers' config and model classes of ``arch`` (``HF_CLASSES``)."""
    import transformers

    config_name, model_name = HF_CLASSES[arch]
    return getattr(transformers, config_name), getattr(transformers, model_name)


def check_against_hf(device: str | torch.device, dtype: str, tolerance: float) -> OracleVerdict:
    """Save the oracle's checkpoint to a temporary directory, run ``oracle_workload`` on a fresh
    plan-path worker of batchgen's load of it and HF greedy ``generate`` on HF's; every request
    must agree (near-ties allowed). Mutates nothing outside its temporary directory."""
    if importlib.util.find_spec("transformers") is None:
        return OracleVerdict("HF oracle: skipped (transformers is not installed)")
    workload = oracle_workload()
    with tempfile.TemporaryDirectory(prefix="batchgen-hf-oracle-") as directory:
        hf_model = save_hf_model(directory, seed=ORACLE_SEED, **oracle_geometry())
        ours = load_model(directory, device=device, dtype=dtype)
    hf_model = hf_model.to(device=device, dtype=SUPPORTED_DTYPES[dtype])
    worker = Worker(
        ours,
        cache_config=workload.cache.model_copy(update={"dtype": dtype}),
        engine_config=workload.engine,
        device=device,
    )
    try:
        result = run_workload(worker, workload, check_integrity=True)
    except Exception as error:  # a broken KV path: a failure of the oracle's run, not a crash
        message = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        failure = f"HF oracle: raised at step {worker.state.step}: {message}"
        return OracleVerdict("HF oracle: the engine's run raised", (failure,))
    failures = []
    for request in workload.requests:
        output = result.outputs[request.uuid]
        theirs = hf_greedy(hf_model, request.prompt_ids, len(output.output_ids))
        if near_tie(theirs, output, tolerance) is False:
            failures.append(
                f"HF oracle: {request.uuid}: tokens {list(output.output_ids)} != HF transformers'"
                f" {theirs} (first difference not a near-tie)"
            )
    agreed = "tokens equal HF transformers" if not failures else f"{len(failures)} differ"
    num_requests, num_evictions = len(workload.requests), result.stats.evictions
    line = f"HF oracle: {num_requests} requests, {num_evictions} evictions: {agreed}"
    return OracleVerdict(line, tuple(failures))


def oracle_geometry() -> dict:
    """The tiny model's geometry as HF config keys. Pure."""
    config = TINY_MODELS["tiny"]
    return dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_context,
    )


def oracle_workload() -> Workload:
    """Four seeded requests over 12 GPU pages of 4 tokens (8 host pages): evictions and loads."""
    rng = random.Random(7)
    vocab_size = TINY_MODELS["tiny"].vocab_size
    requests = [
        WorkloadRequest(
            uuid=f"hf-r{i}",
            prompt_ids=[rng.randrange(1, vocab_size) for _ in range(rng.randint(6, 20))],
            max_new_tokens=NUM_NEW_TOKENS,
        )
        for i in range(NUM_REQUESTS)
    ]
    cache = CacheConfig(page_size=4, num_gpu_pages=12, num_host_pages=8)
    return Workload(
        name="hf-oracle", cache=cache, engine=EngineConfig(max_num_seqs=4), requests=requests
    )


def randomise_(model: torch.nn.Module, seed: int) -> None:
    """Logits of order 1 (clear argmax), norms and biases away from 1 and 0 so all parameters
    matter; mutates model."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            elif name == "model.embed_tokens.weight":
                param.copy_(noise)
            else:
                param.copy_(noise / math.sqrt(param.shape[1]))


def save_hf_model(
    path, arch: str = "llama", *, seed: int = 0, max_shard_size: str | None = None, **geometry
):
    """An HF model with seeded random weights (``randomise_``), saved to ``path`` in HF format;
    returns the HF model (float32, eager attention)."""
    config_class, model_class = hf_classes(arch)
    hf_model = model_class(config_class(attn_implementation="eager", **geometry)).eval()
    randomise_(hf_model, seed)
    hf_model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return hf_model


def hf_greedy(twin, prompt_ids: list[int], num_new_tokens: int) -> list[int]:
    """HF greedy ``generate`` of one request, ``num_new_tokens`` long (no end-of-sequence stop)."""
    device = next(twin.parameters()).device
    input_ids = torch.tensor([prompt_ids], device=device)
    with torch.inference_mode():
        generated = twin.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_new_tokens,
            min_new_tokens=num_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return generated[0, len(prompt_ids) :].tolist()


def near_tie(hf_tokens: list[int], ours: RequestOutput, tolerance: float) -> bool | None:
    """None when batchgen's tokens equal HF's; else whether the first differing token is a near-tie:
    both tokens are batchgen's top two there, their log-probabilities within ``tolerance``. Pure."""
    ours_tokens = list(ours.output_ids)
    if ours_tokens == hf_tokens:
        return None
    position = next((i for i, (a, b) in enumerate(zip(hf_tokens, ours_tokens)) if a != b), None)
    if position is None:  # one is a prefix of the other
        return False
    logprobs = dict(
        zip(ours.output_logprobs[position].top_ids, ours.output_logprobs[position].top_logprobs)
    )
    tokens = (hf_tokens[position], ours_tokens[position])
    return (
        all(t in logprobs for t in tokens)
        and abs(logprobs[tokens[0]] - logprobs[tokens[1]]) < tolerance
    )
