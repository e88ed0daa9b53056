"""Linear layers on CPU through oneDNN, with each weight packed once at load.

torch's CPU ``F.linear`` in float32 calls MKL's sgemm, which on CPUs other than Intel's takes a
generic code path: on this project's AMD benchmark machine oneDNN's kernels over a weight
reordered once into their blocked layout run the decode and prefill matmuls 2-2.6x faster
(``docs/benchmarks-engine.md``). In bfloat16 ``F.linear`` runs oneDNN itself, but reorders the
weight on every call. vLLM's CPU backend packs its weights the same way.

The packed weight replaces the dense one (no second copy), but for a tied lm_head, whose dense
weight stays as the embedding. It is an opaque oneDNN tensor, so the module gives its weight back
densely where a caller asks (``weight``, ``state_dict``): the reorder is exact both ways.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# oneDNN picks its blocking for this many rows; measured on 1-2,348 rows, any hint of 16 to 1,024
# runs every row count within a few percent of the best
BATCH_HINT = 32


class OneDNNLinear(nn.Module):
    """``nn.Linear`` without bias or with one, its weight held packed for oneDNN."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
            linear.weight.detach(), batch_size=BATCH_HINT
        )
        self.bias = linear.bias

    @property
    def weight(self) -> Tensor:
        """The weight, dense ``[out_features, in_features]``: a fresh copy, for reading."""
        return self.packed_weight.to_dense()

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        """The dense weight under HF's name ``weight``, then the bias, as ``nn.Linear`` saves
        them."""
        destination[prefix + "weight"] = self.weight
        super()._save_to_state_dict(destination, prefix, keep_vars)


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether linears on ``device`` in ``dtype`` run through oneDNN: float32 or bfloat16 on a CPU
    whose torch has oneDNN. Pure."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
    )


def pack_linears(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> None:
    """Replace every ``nn.Linear`` of ``model`` but those in ``skip`` by a ``OneDNNLinear``;
    mutates ``model``, and frees each dense weight once packed."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and not any(child is kept for kept in skip):
                setattr(parent, name, OneDNNLinear(child))
