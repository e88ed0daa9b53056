"""What a worker accepts as a request: the checks ``Worker.add_request`` runs first."""

from __future__ import annotations

import math
import numbers

from batchgen.config import CacheConfig, ModelConfig, pages_needed
from batchgen.engine.faults import OWNER_PREFIX as FAULT_OWNER_PREFIX
from batchgen.sampling_params import sampling_problem
from batchgen.state import Request, WorkerState


class RequestError(ValueError):
    """A request was rejected; the worker state is unchanged."""


def check_request(
    request: Request, state: WorkerState, model: ModelConfig, cache: CacheConfig
) -> None:
    """RequestError naming what is wrong when a worker in ``state``, serving ``model`` on
    ``cache``, cannot take ``request``. Pure."""
    _check_types(request)
    uuid, prompt = request.uuid, request.prompt_ids
    where = f"request {uuid!r}"
    if uuid in state.requests or uuid in state.outputs:
        raise RequestError(f"{where}: uuid already used; uuids must be unique per worker")
    if uuid.startswith(FAULT_OWNER_PREFIX):
        raise RequestError(
            f"{where}: uuids starting with {FAULT_OWNER_PREFIX!r} are reserved (fault injection"
            " holds pool pages under them)"
        )
    if not prompt:
        raise RequestError(f"{where}: empty prompt; a prompt needs at least one token")
    if request.max_new_tokens < 1:
        raise RequestError(f"{where}: max_new_tokens={request.max_new_tokens}; must be >= 1")
    if not (math.isfinite(request.temperature) and request.temperature >= 0):
        raise RequestError(
            f"{where}: temperature={request.temperature}; must be a finite number >= 0 (0 = greedy)"
        )
    problem = sampling_problem(request.sampling, request.max_new_tokens, model.vocab_size)
    if problem is not None:
        raise RequestError(f"{where}: sampling.{problem}")
    bad = [t for t in prompt if not 0 <= t < model.vocab_size]
    if bad:
        raise RequestError(
            f"{where}: token ids {bad[:5]} outside the vocabulary [0, {model.vocab_size})"
        )
    _check_fits(where, len(prompt) + request.max_new_tokens, request, model, cache)


def _check_fits(
    where: str, total: int, request: Request, model: ModelConfig, cache: CacheConfig
) -> None:
    """RequestError when ``total`` tokens exceed the model's context or the usable GPU pages."""
    if total > model.max_context:
        raise RequestError(
            f"{where}: prompt ({len(request.prompt_ids)}) + max_new_tokens"
            f" ({request.max_new_tokens}) = {total} exceeds the model's context of"
            f" {model.max_context} tokens"
        )
    usable = cache.num_gpu_pages - cache.watermark_pages
    num_pages = pages_needed(total, cache.page_size)
    if num_pages > usable:
        raise RequestError(
            f"{where}: needs {num_pages} KV pages but the GPU pool has {usable} usable pages"
            f" ({cache.num_gpu_pages} minus the watermark)"
        )


def _check_types(request: Request) -> None:
    """RequestError naming the first field of ``request`` whose type the worker cannot use (a
    float token id would pass the vocabulary check and then fail every later step in the
    embedding). Pure."""
    if not isinstance(request, Request):
        raise RequestError(f"expected a Request, got {type(request).__name__}")
    uuid = request.uuid
    if type(uuid) is not str:
        raise RequestError(f"request uuid {uuid!r}: must be a str, not {type(uuid).__name__}")
    where = f"request {uuid!r}"
    prompt = request.prompt_ids
    if type(prompt) not in (tuple, list):
        raise RequestError(
            f"{where}: prompt_ids must be a tuple of ints, not {type(prompt).__name__} (convert"
            " an array or tensor with tuple(ids.tolist()))"
        )
    not_int = [token for token in prompt if not _is_integer(token)]
    if not_int:
        raise RequestError(f"{where}: prompt_ids must be ints; got {not_int[:5]!r}")
    for field, value in (("max_new_tokens", request.max_new_tokens), ("seed", request.seed)):
        if not _is_integer(value):
            raise RequestError(
                f"{where}: {field} must be an int, not {type(value).__name__} {value!r}"
            )
    temperature = request.temperature
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool):
        raise RequestError(
            f"{where}: temperature must be a number, not {type(temperature).__name__} "
            f"{temperature!r}"
        )


def _is_integer(value) -> bool:
    """An int, or an integer scalar such as numpy's, but not a bool (True is 1 to Python). Pure."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
