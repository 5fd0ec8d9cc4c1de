"""The graph ops, each declared once: its method's name, positional tensors and their roles, its
own keywords with their defaults, and its outputs (those always made, those a keyword asks for).

``Graph``'s op methods pass their arguments by name to ``Recording.record_call``, which reads
this table to key the call and make the outputs; ``interpret.py`` reads the arguments by the
same names when the graph is built; ``tests/test_ops_table.py`` checks each row against its
method's signature and docstring. The mask, scale, length and dropout keywords every op takes
(``**mask``) are ``keywords.MaskKeywords``'s, not repeated here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..core import roles
from ..core.problem import Op

STATS = "generate_stats"  # the flag that asks for Stats, with is_inference (the frontend's pair)


@dataclass(frozen=True)
class Output:
    """One output of an op: made on every call, or only when ``flag`` or ``given`` asks for it."""

    role: str
    flag: str | None = None  # a keyword whose true value asks for it
    given: str | None = None  # a keyword through which the caller gives the tensor that receives it


@dataclass(frozen=True)
class OpSpec:
    name: str  # the Graph method
    op: Op
    fp8: bool
    positional: tuple[tuple[str, str], ...]  # (parameter, role): the method's positional tensors, in order
    keywords: tuple[tuple[str, Any], ...]  # (keyword, default): the method's own keywords, in order
    outputs: tuple[Output, ...]  # in the order the node holds them
    inputs: tuple[str, ...]  # the run's input roles, in the order of the method's parameters
    arguments: tuple[str, ...] = field(init=False)  # every parameter by name: what the recording keys

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", tuple(p for p, _ in self.positional) + tuple(k for k, _ in self.keywords))

    def tensors(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """The positional tensors of a call, by role."""
        return {role: arguments[parameter] for parameter, role in self.positional}


QKV = (("q", "q"), ("k", "k"), ("v", "v"))
GRADIENT_INPUTS = (*QKV, ("o", "o"), ("dO", "grad_o"), ("stats", "stats"))
GRADIENTS = (Output("grad_q"), Output("grad_k"), Output("grad_v"))
# sdpa_fp8_backward's scale parameters, in the order of their roles (roles.FP8_BACKWARD_SCALES).
FP8_BACKWARD_PARAMETERS = (
    *("descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP"),
    *("scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP"),
)

SDPA = OpSpec(
    "sdpa",
    Op.FORWARD,
    fp8=False,
    positional=QKV,
    keywords=(
        ("is_inference", None),
        ("generate_stats", None),
        ("paged_attention_k_table", None),
        ("paged_attention_v_table", None),
        ("paged_attention_max_seq_len_kv", None),
        ("kv_cache_layout", None),
        ("compute_data_type", None),
        ("rng_dump", None),
        ("name", None),
    ),
    outputs=(Output("o"), Output("stats", flag=STATS), Output("rng_dump", given="rng_dump")),
    inputs=roles.SDPA_INPUTS,
)
PAGED = OpSpec(
    "sdpa_with_paged_cache",
    Op.FORWARD,
    fp8=False,
    positional=(*QKV, ("page_table", "page_table_k")),
    keywords=(
        ("seq_len_q", None),
        ("seq_len_kv", None),
        ("page_table_v", None),
        ("max_seq_len_kv", None),
        ("kv_cache_layout", None),
        ("name", None),
    ),
    outputs=(Output("o"),),
    inputs=roles.PAGED_INPUTS,
)
BACKWARD = OpSpec(
    "sdpa_backward",
    Op.BACKWARD,
    fp8=False,
    positional=GRADIENT_INPUTS,
    keywords=(
        ("use_deterministic_algorithm", False),
        ("bias_grad", False),
        ("dBias", None),
        ("compute_data_type", None),
        ("name", None),
        ("dSink_token", None),
    ),
    outputs=(
        *GRADIENTS,
        Output("grad_bias", flag="bias_grad", given="dBias"),
        Output("grad_sink", given="dSink_token"),
    ),
    inputs=roles.BACKWARD_INPUTS,
)
FP8 = OpSpec(
    "sdpa_fp8",
    Op.FORWARD,
    fp8=True,
    positional=(*QKV, *zip(roles.FP8_SCALES, roles.FP8_SCALES)),
    keywords=(
        ("is_inference", None),
        ("generate_stats", None),
        ("compute_data_type", None),
        ("name", None),
        ("fn", None),
    ),
    outputs=(Output("o"), Output("stats", flag=STATS), *map(Output, roles.FP8_AMAXES)),
    inputs=roles.FP8_INPUTS,
)
FP8_BACKWARD = OpSpec(
    "sdpa_fp8_backward",
    Op.BACKWARD,
    fp8=True,
    positional=(*GRADIENT_INPUTS, *zip(FP8_BACKWARD_PARAMETERS, roles.FP8_BACKWARD_SCALES)),
    keywords=(
        ("use_deterministic_algorithm", False),
        ("compute_data_type", None),
        ("name", None),
        ("dSink_token", None),
    ),
    outputs=(*GRADIENTS, *map(Output, roles.FP8_BACKWARD_AMAXES), Output("grad_sink", given="dSink_token")),
    inputs=roles.FP8_BACKWARD_INPUTS,
)

OPS: dict[str, OpSpec] = {spec.name: spec for spec in (SDPA, PAGED, BACKWARD, FP8, FP8_BACKWARD)}
