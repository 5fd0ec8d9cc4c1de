"""torch's SDPA kernel as a ``Backend``: the plain forward problems a ``Graph`` records.

``cudnn_attn.backend("torch")`` (or ``Graph(backend="torch")``) runs a graph's node on
``torch.nn.functional.scaled_dot_product_attention`` where the node is one torch's signature
can say: a dense forward with no log-sum-exp, an optional additive bias and a top-left causal
mask. Everything else is refused by name, so a graph asked to run here fails at build, listing
what torch's kernel lacks. The drop-in ``cudnn_attn.sdpa`` runs its calls on torch's kernels
directly (``kernel.py``, ``cudnn_op.py``); training goes through torch's autograd there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ...core.mask import Causal
from ...core.problem import AttentionProblem
from ..base import RunInputs

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class TorchBackend:
    """Plain forward problems on torch's own SDPA kernel, on any device torch runs on."""

    name = "torch"
    tunable = False  # torch picks its kernel per call
    stores_plans = False  # a plan is the problem alone

    def not_supported_reasons(self, problem: AttentionProblem) -> list[str]:
        p, options = problem, problem.options
        if not p.is_forward:
            return ["sdpa_backward: torch's kernel is differentiated by autograd, not run as a backward op"]
        checks = (
            (p.generates_stats, "generate_stats: torch's SDPA kernel returns no log-sum-exp"),
            (p.is_fp8, "FP8: torch's SDPA kernel has no FP8 attention"),
            (p.is_paged, "paged K/V caches: torch's SDPA kernel takes dense K/V"),
            (p.is_thd, "ragged (THD) tensors: torch's SDPA kernel takes dense batches"),
            (options.padding, "use_padding_mask: torch's SDPA kernel takes no sequence lengths"),
            (options.has_dropout, "dropout: torch's SDPA kernel draws from torch's generator, not dropout_seed"),
            (options.alibi, "use_alibi_mask: torch's SDPA kernel has no ALiBi"),
            (options.causal is Causal.BOTTOM_RIGHT, "use_causal_mask_bottom_right: torch's is_causal is top-left"),
            (
                options.sliding_window is not None or options.right_bound is not None,
                "sliding_window_length: torch's SDPA kernel has no band mask",
            ),
            (p.score_mod is not None, "score_mod: torch's SDPA kernel takes no score modifier"),
            (p.sink_token is not None, "sink_token: torch's SDPA kernel has no attention sinks"),
            (p.scale_tensor is not None, "attn_scale as a tensor: torch's SDPA kernel takes a float scale"),
            (p.rng_dump is not None, "rng_dump: torch's SDPA kernel has no dropout mask to dump"),
        )
        found = [reason for failed, reason in checks if failed]
        dtypes = {p.q.dtype, p.k.dtype, p.v.dtype, p.o.dtype}
        if len(dtypes) > 1 or p.q.dtype not in DTYPES:
            found.append(
                f"dtype={p.q.dtype}: torch's SDPA kernel takes q, k, v and o of one float16, bfloat16, "
                "float32 or float64 dtype"
            )
        return found

    def plan_key(self, problem: AttentionProblem) -> tuple:
        return (torch.__version__,)

    def build(self, problem: AttentionProblem, *, autotune: bool = False, store: Any = None) -> TorchPlan:
        """Nothing to build, tune or store: torch picks its kernel per call."""
        return TorchPlan(problem)

    def from_blob(self, problem: AttentionProblem, blob: bytes) -> TorchPlan:
        return TorchPlan(problem)

    def to_blob(self, plan: Any) -> bytes:
        return b""


class TorchPlan:
    """A plain forward problem's run on ``torch.nn.functional.scaled_dot_product_attention``."""

    workspace_size = 0
    nbytes = 0

    def __init__(self, problem: AttentionProblem):
        self.problem = problem
        self.is_causal = problem.options.causal is Causal.TOP_LEFT
        self.scale = float(problem.options.attn_scale)
        self.gqa = problem.h_q != problem.h_k

    def __call__(
        self,
        inputs: RunInputs,
        outputs: Mapping[str, torch.Tensor],
        *,
        stream: Any = None,
        workspace: torch.Tensor | None = None,
        handle: Any = None,
    ) -> None:
        """Compute O on the current stream (as the reference backend does, ``stream`` is not read)."""
        q, k, v, bias = (inputs.get(role) for role in ("q", "k", "v", "bias"))
        out = torch.nn.functional.scaled_dot_product_attention(
            q,  # type: ignore[arg-type]
            k,  # type: ignore[arg-type]
            v,  # type: ignore[arg-type]
            attn_mask=bias,  # type: ignore[arg-type]
            is_causal=self.is_causal,
            scale=self.scale,
            enable_gqa=self.gqa,
        )
        outputs["o"].copy_(out)

    # The frontend's plan helpers: torch's kernel is one plan.
    def plan_count(self) -> int:
        return 1

    def plan_name_at(self, index: int) -> str:
        return "torch"

    def at_index(self, index: int) -> TorchPlan:
        return self
