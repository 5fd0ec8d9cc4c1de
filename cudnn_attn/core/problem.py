"""The attention problem: one frozen, hashable description of one graph node.

An ``AttentionProblem`` holds everything that changes the computation a plan performs:
every tensor's geometry (shape, strides, dtype, device), the data types, the mask and its
parameters, the scale, dropout, paging and the training flag. It is the validation input,
the plan-cache key and the test id. It holds no tensor data: per-run values (sequence
lengths, page tables, dropout seeds) travel with the run, never in the key.

Logical conventions (those of the cuDNN frontend):

- dense q/k/v/o/dO/dQ/dK/dV are 4-D ``[B, H, S, D]`` with any strides (BSHD is a
  transposed view, SBHD a permuted one);
- THD (ragged) tensors are 3-D ``[T, H, D]``: sequences packed back to back, token
  ``seq_offset[b] + i`` of the packed axis is row ``i`` of batch ``b``;
- paged K/V caches are 4-D ``[num_pages, page_size, H_kv, D]`` ("NPHD") or
  ``[num_pages, H_kv, page_size, D]`` ("NHPD");
- stats (log-sum-exp of the scaled, masked scores, natural log) are ``[B, H_q, S_q, 1]`` float32.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .mask import Causal, ScoreOptions
from .roles import ROLES

if TYPE_CHECKING:
    from .score_mod import ScoreModifier


class Op(str, enum.Enum):
    """A node's operation: the forward (``sdpa``, ``sdpa_fp8``, paged) or the backward.

    Example:
        ```python
        import cudnn_attn

        assert cudnn_attn.Op("sdpa") is cudnn_attn.Op.FORWARD
        ```
    """

    FORWARD = "sdpa"
    BACKWARD = "sdpa_backward"


class KVCacheLayout(str, enum.Enum):
    """How a paged K/V cache is laid out: ``NPHD`` is ``[num_pages, page_size, H_kv, D]``,
    ``NHPD`` is ``[num_pages, H_kv, page_size, D]``.

    Example:
        ```python
        import cudnn_attn

        assert cudnn_attn.KVCacheLayout("NHPD") is cudnn_attn.KVCacheLayout.NHPD
        ```
    """

    NPHD = "NPHD"  # [num_pages, page_size, H_kv, D]
    NHPD = "NHPD"  # [num_pages, H_kv, page_size, D]


@dataclass(frozen=True)
class TensorSpec:
    """The geometry of one tensor: what a plan is specialised on (no data).

    Args:
        shape: the dims.
        stride: the strides, in elements.
        dtype: the torch dtype.
        device: ``"cpu"`` or ``"cuda:N"``.

    Example:
        ```python
        import torch

        import cudnn_attn

        spec = cudnn_attn.TensorSpec.of(torch.randn(2, 8, 128, 64).transpose(1, 2))
        assert spec.shape == (2, 128, 8, 64) and spec.stride == (65536, 64, 8192, 1)
        ```
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: str

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorSpec:
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, device_name(tensor.device))

    @classmethod
    def contiguous(cls, shape: tuple[int, ...], dtype: torch.dtype, device: str) -> TensorSpec:
        return cls(tuple(shape), contiguous_strides(shape), dtype, device)

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"shape={list(self.shape)} stride={list(self.stride)} dtype={dtype} device={self.device}"


def device_name(device: torch.device | str) -> str:
    """One spelling per device: "cpu", "cuda:0" (a bare "cuda" is the current CUDA device).

    Raises ``ValueError`` or ``RuntimeError`` (from torch) for a string that names no device.
    """
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return str(d)


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, running = [], 1
    for size in reversed(shape):
        strides.append(running)
        running *= max(size, 1)
    return tuple(reversed(strides))


def strides_like(shape: tuple[int, ...], template_stride: tuple[int, ...]) -> tuple[int, ...]:
    """Dense strides for ``shape`` with the dimension order of ``template_stride``.

    How an output inherits its input's layout: O of a BSHD q is BSHD too.
    """
    # The head dim stays innermost; broadcast (stride-0) dims go outermost; the rest keep
    # the template's order, outermost first.
    last = len(shape) - 1
    outer_first = sorted(range(last), key=lambda i: (template_stride[i] != 0, -template_stride[i], i))
    strides = [0] * len(shape)
    running = 1
    for i in [last, *reversed(outer_first)] if shape else []:
        strides[i] = running
        running *= max(shape[i], 1)
    return tuple(strides)


@dataclass(frozen=True)
class AttentionProblem:
    """One attention node, frozen and hashable: the validation input, the plan-cache key and the test id.

    It holds every tensor's geometry (``TensorSpec`` by role: ``q``, ``k``, ``v``, ``o``,
    ``stats``, ``bias``, the gradients, lengths, page tables, FP8 scales, ...), the data types,
    the mask, scale, dropout and paging options, and the training flag; no tensor data. Equal
    problems share one built plan. ``Graph.problems`` lists a built graph's; ``describe()``
    gives the short id used in logs and errors.

    Attributes:
        op: ``Op.FORWARD`` or ``Op.BACKWARD``.
        q: the queries' geometry; ``k``, ``v``, ``o`` and the other roles likewise (None when
            absent).
        options: the ``ScoreOptions``: ``attn_scale``, ``causal``, ``sliding_window``,
            ``alibi``, ``padding``, ``dropout_p``.
        kv_cache_layout: ``KVCacheLayout`` when K/V are paged caches, else None.

    Example:
        ```python
        import torch

        import cudnn_attn

        q = torch.randn(2, 8, 128, 64, dtype=torch.float16)
        with cudnn_attn.Graph() as g:
            g.sdpa(q, q, q, use_causal_mask=True)
        (problem,) = g.problems
        print(problem.describe(), problem.flops())
        ```
    """

    op: Op
    q: TensorSpec
    k: TensorSpec
    v: TensorSpec
    o: TensorSpec  # forward: output; backward: input
    stats: TensorSpec | None = None  # forward: output when generated; backward: input
    rng_dump: TensorSpec | None = None  # forward: the dropout keep-mask [B, H_q, S_q, S_kv] float32, when asked
    grad_o: TensorSpec | None = None  # backward only, as are the three below
    grad_q: TensorSpec | None = None
    grad_k: TensorSpec | None = None
    grad_v: TensorSpec | None = None
    bias: TensorSpec | None = None
    grad_bias: TensorSpec | None = None
    seq_len_q: TensorSpec | None = None
    seq_len_kv: TensorSpec | None = None
    page_table_k: TensorSpec | None = None
    page_table_v: TensorSpec | None = None
    dropout_seed: TensorSpec | None = None  # a tensor seed/offset is a run input
    dropout_offset: TensorSpec | None = None
    # attn_scale given as a graph tensor (the frontend's pass-by-value scale): float32, one value,
    # read at each run; options.attn_scale is then 1 and only keys the plan.
    scale_tensor: TensorSpec | None = None
    # Attention sinks (gpt-oss): a float32 [1, H_q, 1, 1] logit per query head, one more term of each
    # row's softmax denominator (it weighs no value); the backward's dSink_token has its shape.
    sink_token: TensorSpec | None = None
    grad_sink: TensorSpec | None = None
    # FP8 nodes only (see roles.FP8_SCALES): float32 [1, 1, 1, 1] scale inputs and amax outputs.
    descale_q: TensorSpec | None = None
    descale_k: TensorSpec | None = None
    descale_v: TensorSpec | None = None
    descale_s: TensorSpec | None = None
    scale_s: TensorSpec | None = None
    scale_o: TensorSpec | None = None
    amax_s: TensorSpec | None = None
    amax_o: TensorSpec | None = None
    descale_o: TensorSpec | None = None
    descale_grad_o: TensorSpec | None = None
    descale_grad_p: TensorSpec | None = None
    scale_grad_q: TensorSpec | None = None
    scale_grad_k: TensorSpec | None = None
    scale_grad_v: TensorSpec | None = None
    scale_grad_p: TensorSpec | None = None
    amax_grad_q: TensorSpec | None = None
    amax_grad_k: TensorSpec | None = None
    amax_grad_v: TensorSpec | None = None
    amax_grad_p: TensorSpec | None = None
    # The caller's ragged offsets (the frontend's ``set_ragged_offset``), int32/int64 [B + 1, 1, 1, 1]:
    # sequence b of that 4-D tensor starts offset[b] elements into its memory; its batch stride is unused.
    q_offset: TensorSpec | None = None
    k_offset: TensorSpec | None = None
    v_offset: TensorSpec | None = None
    o_offset: TensorSpec | None = None
    stats_offset: TensorSpec | None = None
    grad_o_offset: TensorSpec | None = None
    grad_q_offset: TensorSpec | None = None
    grad_k_offset: TensorSpec | None = None
    grad_v_offset: TensorSpec | None = None
    page_table_k_offset: TensorSpec | None = None
    page_table_v_offset: TensorSpec | None = None
    io_dtype: torch.dtype | None = None
    intermediate_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    options: ScoreOptions = ScoreOptions()  # scale, causal, window, ALiBi, padding, dropout
    kv_cache_layout: KVCacheLayout | None = None  # set exactly when K/V are paged
    max_seq_len_q: int | None = None  # THD: the padded length cuDNN plans for
    max_seq_len_kv: int | None = None  # THD and paged
    deterministic: bool = False
    # The frontend's score_mod / score_mod_bprop (core/score_mod.py): a pointwise expression on the
    # scores. The graph tensors it reads are the roles score_input_0, ...: their specs live in it.
    score_mod: ScoreModifier | None = None

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields: the score modifier's inputs, by role.
        if name.startswith("score_input_") and name[12:].isdigit():
            mod = self.__dict__.get("score_mod")
            index = int(name[12:])
            return mod.inputs[index] if mod is not None and index < len(mod.inputs) else None
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __hash__(self) -> int:
        # Problems key every plan-cache lookup: their fields are hashed once, not per lookup.
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in dataclasses.fields(self)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def for_plan(self) -> AttentionProblem:
        """The problem a plan is built and cached for. A packed (THD) tensor's token count
        does not enter cuDNN's forward graph (it sees ``[B, H, S_max, D]`` and offsets), so with
        both maximum lengths given a forward takes the most tokens the batch can hold: one plan
        serves every packing of the same geometry, and plans read the real count from their
        inputs. A backward's workspace is sized by its token counts (``max_total_seq_len``, not
        batch x longest sequence), so its counts are rounded up to a ``token_bucket`` instead:
        one plan serves every packing within 1/16 above its count."""
        if not self.is_thd or self.max_seq_len_q is None or (self.max_seq_len_kv is None and not self.is_paged):
            return self
        most = {"q": self.batch * self.max_seq_len_q, "kv": self.batch * (self.max_seq_len_kv or 0)}
        tokens = most
        if not self.is_forward:
            tokens = {side: min(most[side], token_bucket(t.shape[0])) for side, t in (("q", self.q), ("kv", self.k))}
        changes = {}
        for role, side in (
            ("q", "q"),
            ("o", "q"),
            ("grad_o", "q"),
            ("grad_q", "q"),
            ("k", "kv"),
            ("v", "kv"),
            ("grad_k", "kv"),
            ("grad_v", "kv"),
        ):
            spec = getattr(self, role)
            if spec is not None and spec.rank == 3:
                changes[role] = dataclasses.replace(spec, shape=(tokens[side], *spec.shape[1:]))
        return dataclasses.replace(self, **changes) if changes else self

    # ---- derived geometry (valid once validation passed) ------------------------------

    @property
    def is_forward(self) -> bool:
        return self.op is Op.FORWARD

    @property
    def generates_stats(self) -> bool:
        return self.is_forward and self.stats is not None

    @property
    def is_fp8(self) -> bool:
        """An sdpa_fp8 / sdpa_fp8_backward node: FP8 data with per-tensor scales."""
        return self.descale_q is not None

    @property
    def is_thd(self) -> bool:
        return self.q.rank == 3

    @property
    def offset_tensors(self) -> tuple[str, ...]:
        """The tensors (roles) whose sequences the caller places with ragged offsets."""
        cached = self.__dict__.get("_offset_tensors")
        if cached is None:
            cached = tuple(role for role in _OFFSET_OF if getattr(self, f"{role}_offset") is not None)
            object.__setattr__(self, "_offset_tensors", cached)
        return cached

    @property
    def is_paged(self) -> bool:
        return self.kv_cache_layout is not None

    @property
    def has_dropout(self) -> bool:
        return self.options.has_dropout

    @property
    def batch(self) -> int:
        if self.is_thd:
            return self.seq_len_q.shape[0] if self.seq_len_q is not None else 1
        return self.q.shape[0]

    @property
    def h_q(self) -> int:
        return self.q.shape[1]  # [B, H, S, D] and [T, H, D] alike

    @property
    def h_k(self) -> int:
        return _heads(self.k, self)

    @property
    def h_v(self) -> int:
        return _heads(self.v, self)

    @property
    def d_qk(self) -> int:
        return self.q.shape[-1]

    @property
    def d_v(self) -> int:
        return self.v.shape[-1]

    @property
    def s_q(self) -> int:
        if self.is_thd:
            return self.max_seq_len_q if self.max_seq_len_q is not None else self.q.shape[0]
        return self.q.shape[2]

    @property
    def s_kv(self) -> int:
        if self.max_seq_len_kv is not None and (self.is_paged or self.is_thd):
            return self.max_seq_len_kv
        if self.is_paged:
            return self.pages_per_seq * (self.page_size or 0)
        if self.is_thd:
            return self.k.shape[0]
        return self.k.shape[2]

    @property
    def pages_per_seq(self) -> int:
        table = self.page_table_k
        if table is None:
            return 0
        return table.shape[1] if table.rank == 2 else table.shape[2] if table.rank == 4 else 0

    @property
    def page_size(self) -> int | None:
        if self.kv_cache_layout is None:
            return None
        return self.k.shape[1] if self.kv_cache_layout is KVCacheLayout.NPHD else self.k.shape[2]

    @property
    def layout(self) -> str:
        """The name of q's layout: BHSD, BSHD, SBHD, THD, or "strided" for anything else."""
        return layout_name(self.q)

    @property
    def device(self) -> str:
        return self.q.device

    @property
    def stats_shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.h_q, self.s_q, 1)

    def replace(self, **changes: Any) -> AttentionProblem:
        """A copy with ``changes``; option fields (``causal=``, ``attn_scale=``, ...) may be given
        directly and land in ``options``."""
        option_names = {f.name for f in dataclasses.fields(ScoreOptions)}
        options = {name: changes.pop(name) for name in list(changes) if name in option_names}
        if options:
            changes["options"] = dataclasses.replace(changes.get("options", self.options), **options)
        return dataclasses.replace(self, **changes)

    def tensor_specs(self) -> dict[str, TensorSpec]:
        """Every tensor of the problem by role, inputs and outputs alike."""
        specs = {
            f.name: value for f in dataclasses.fields(self) if isinstance(value := getattr(self, f.name), TensorSpec)
        }
        if self.score_mod is not None:
            specs.update({f"score_input_{i}": spec for i, spec in enumerate(self.score_mod.inputs)})
        return specs

    def flops(self) -> float:
        """Matrix-multiply FLOPs of this node (causal halves the forward's; backward is 2.5x)."""
        b, h, s_q, s_kv = self.batch, self.h_q, self.s_q, self.s_kv
        forward = 2.0 * b * h * s_q * s_kv * (self.d_qk + self.d_v)
        if self.options.causal is not Causal.NONE:
            forward /= 2
        return forward if self.is_forward else 2.5 * forward

    def describe(self) -> str:
        """A short, human id: used in test ids, logs and error messages."""
        parts = [
            self.op.value,
            self.layout,
            str(self.q.dtype).removeprefix("torch."),
            f"b{self.batch}",
            f"h{self.h_q}" + (f"/{self.h_k}" if self.h_k != self.h_q else ""),
            f"s{self.s_q}" + (f"x{self.s_kv}" if self.s_kv != self.s_q else ""),
            f"d{self.d_qk}" + (f"/{self.d_v}" if self.d_v != self.d_qk else ""),
        ]
        options = self.options
        if options.causal is not Causal.NONE:
            parts.append(f"causal-{options.causal.value}")
        if options.sliding_window is not None:
            parts.append(f"window{options.sliding_window}")
        if options.right_bound is not None:
            parts.append(f"right{options.right_bound}")
        if options.bottom_right:
            parts.append("bottom-right")
        if options.padding:
            parts.append("padding")
        if self.offset_tensors:
            parts.append("ragged-" + "+".join(self.offset_tensors))
        if options.alibi:
            parts.append("alibi")
        if self.bias is not None:
            parts.append("bias" + "".join("1" if s == 1 else "x" for s in self.bias.shape))
        if self.has_dropout:
            parts.append(f"dropout{options.dropout_p:g}")
        if self.is_paged:
            parts.append(f"paged{self.page_size}")
        if self.sink_token is not None:
            parts.append("sinks")
        if self.score_mod is not None:
            parts.append(self.score_mod.name)
        return "-".join(parts)


_OFFSET_OF = tuple(role.offsets_of for role in ROLES.values() if role.offsets_of is not None)


def _heads(spec: TensorSpec, problem: AttentionProblem) -> int:
    if spec.rank == 3:
        return spec.shape[1]
    if problem.kv_cache_layout is KVCacheLayout.NPHD:
        return spec.shape[2]
    return spec.shape[1]


def layout_name(spec: TensorSpec) -> str:
    if spec.rank == 3:
        return "THD"
    if spec.rank != 4:
        return "strided"
    b, h, s, _ = spec.stride
    # Sizes of 1 make strides ambiguous; ignore such dims when ordering.
    shape = spec.shape
    keyed = [(stride, name) for stride, name, size in zip((b, h, s), "BHS", shape[:3]) if size > 1]
    order = "".join(name for _, name in sorted(keyed, key=lambda x: -x[0]))
    for candidate in ("BHSD", "BSHD", "SBHD"):
        if "".join(c for c in candidate[:3] if c in order) == order:
            return candidate
    return "strided"


def token_bucket(tokens: int) -> int:
    """``tokens`` rounded up to a multiple of 1/16 of its power of two (at least 256): packed
    backward plans are sized by it, so a plan serves every count in its bucket and its workspace
    exceeds the tokens' by at most 1/16."""
    granule = max(256, 1 << max(0, (max(tokens, 1) - 1).bit_length() - 4))
    return -(-max(tokens, 1) // granule) * granule
