"""NullModel: deterministic tokens that never end a request early."""

import pytest

from batchgen.config import TINY_MODELS
from batchgen.model.null_model import NullModel


def test_consecutive_eos_ids_are_all_skipped():
    model = NullModel(TINY_MODELS["tiny"].model_copy(update={"eos_token_ids": (5, 6, 7)}))
    tokens = {model.next_token(last, position) for last in range(512) for position in range(64)}
    assert tokens.isdisjoint({5, 6, 7}) and 8 in tokens


def test_a_vocabulary_of_eos_ids_only_is_rejected():
    config = TINY_MODELS["tiny"].model_copy(update={"vocab_size": 2, "eos_token_ids": (0, 1)})
    with pytest.raises(ValueError, match="every id of the vocabulary"):
        NullModel(config)
