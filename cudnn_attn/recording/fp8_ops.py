"""The FP8 ops of ``Graph``: ``sdpa_fp8`` and ``sdpa_fp8_backward``, with the frontend's names,
positional parameters and outputs.

Q, K, V (and O, dO in the backward) are FP8 (``torch.float8_e4m3fn`` or ``float8_e5m2``);
every scale and descale is a float32 ``[1, 1, 1, 1]`` tensor; the amax outputs are float32
``[1, 1, 1, 1]``. What the ops compute, exactly, is in ``ops/reference/fp8.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.problem import Op
from ..core.roles import (
    FP8_AMAXES,
    FP8_BACKWARD_AMAXES,
    FP8_BACKWARD_INPUTS,
    FP8_BACKWARD_SCALES,
    FP8_INPUTS,
    FP8_SCALES,
)
from .handles import OutputHandle
from .keywords import publishes_mask_keywords, stats_requested
from .state import check_compute_dtype

if TYPE_CHECKING:
    from .node import Node
    from .state import Recording


class Fp8Ops:
    """Mixed into ``Graph``: the methods record into its ``recording``."""

    recording: Recording

    @publishes_mask_keywords
    def sdpa_fp8(
        self,
        q: Any,
        k: Any,
        v: Any,
        descale_q: Any,
        descale_k: Any,
        descale_v: Any,
        descale_s: Any,
        scale_s: Any,
        scale_o: Any,
        *,
        is_inference: bool | None = None,
        generate_stats: bool | None = None,
        compute_data_type: Any = None,
        name: str | None = None,
        fn: Any = None,
        **mask: Any,
    ) -> tuple[OutputHandle, OutputHandle | None, OutputHandle, OutputHandle]:
        """FP8 attention forward (the frontend's ``sdpa_fp8``): ``(O, Stats or None, Amax_S, Amax_O)``.

        S = q k^T * attn_scale * descale_q * descale_k; P = softmax(S) (Amax_S = max|P|) is
        quantised with ``scale_s``; O = (P v) * descale_s * descale_v (Amax_O = max|O|) is
        written as ``O * scale_o`` in O's dtype (q's by default). On a GPU this needs Hopper or
        newer and cuDNN >= 9.7 (not 9.10.0), head dims up to 128 (d_qk up to 192); the reference
        backend emulates it exactly on the CPU. ``cudnn_attn.sdpa_fp8`` does the scaling for
        16-bit callers.

        Args:
            q: ``[B, H_q, S_q, D]`` ``torch.float8_e4m3fn`` (or ``float8_e5m2``).
            k: ``[B, H_kv, S_kv, D]``, q's dtype.
            v: ``[B, H_kv, S_kv, D_v]``, q's dtype.
            descale_q: float32 ``[1, 1, 1, 1]``, the inverse of q's quantisation scale.
            descale_k: as ``descale_q``, for k.
            descale_v: as ``descale_q``, for v.
            descale_s: float32 ``[1, 1, 1, 1]``, the inverse of ``scale_s``.
            scale_s: float32 ``[1, 1, 1, 1]``, P's quantisation scale.
            scale_o: float32 ``[1, 1, 1, 1]``, O's quantisation scale.
            is_inference: the frontend's flag: False generates Stats.
            generate_stats: whether Stats is produced; default False.
            compute_data_type: float32 only.
            name: the node's name.
            fn: the frontend's name here for ``score_mod``: ``(graph, S) -> S'`` on the descaled
                scores before the masks (inference only).
            **mask: the mask and scale keywords of ``sdpa`` (``sink_token`` included).

        Returns:
            ``(O, Stats, Amax_S, Amax_O)`` handles; Stats is None unless generated, the amaxes
            are float32 ``[1, 1, 1, 1]``.

        Example:
            ```python
            import torch

            import cudnn_attn

            q, k, v = (torch.randn(1, 2, 64, 64).to(torch.float8_e4m3fn) for _ in range(3))
            def scale(x):  # every scale and descale: a float32 [1, 1, 1, 1] tensor
                return torch.full((1, 1, 1, 1), x)

            # descale_q, descale_k, descale_v (unit: values as stored), descale_s, scale_s, scale_o
            scales = [scale(1.0), scale(1.0), scale(1.0), scale(1 / 448), scale(448.0), scale(1.0)]
            with cudnn_attn.Graph() as g:
                o, _, amax_s, amax_o = g.sdpa_fp8(q, k, v, *scales, use_causal_mask=True)
            out, amax_s, amax_o = g(q, k, v, *scales)  # O in float8_e4m3fn
            ```
        """
        scales = (descale_q, descale_k, descale_v, descale_s, scale_s, scale_o)
        args = (q, k, v, scales, is_inference, generate_stats, compute_data_type, fn)
        stats = stats_requested(is_inference, generate_stats, [])  # its errors are reported at build
        outputs = ("o", "stats", *FP8_AMAXES) if stats else ("o", *FP8_AMAXES)
        node = self.recording.record_call(Op.FORWARD, name, FP8_INPUTS, "sdpa_fp8", _interpret_fp8, args, mask,
                                          outputs)  # fmt: skip
        node.fp8 = True
        return node.outputs["o"], node.outputs.get("stats"), node.outputs["amax_s"], node.outputs["amax_o"]

    @publishes_mask_keywords
    def sdpa_fp8_backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        o: Any,
        dO: Any,  # noqa: N803 - the frontend's spelling
        stats: Any,
        descale_q: Any,
        descale_k: Any,
        descale_v: Any,
        descale_o: Any,
        descale_dO: Any,  # noqa: N803
        descale_s: Any,
        descale_dP: Any,  # noqa: N803
        scale_s: Any,
        scale_dQ: Any,  # noqa: N803
        scale_dK: Any,  # noqa: N803
        scale_dV: Any,  # noqa: N803
        scale_dP: Any,  # noqa: N803
        *,
        use_deterministic_algorithm: bool = False,
        compute_data_type: Any = None,
        name: str | None = None,
        dSink_token: Any = None,  # noqa: N803 - the frontend's spelling
        **mask: Any,
    ) -> tuple[OutputHandle, ...]:
        """Gradients of ``sdpa_fp8``: ``(dQ, dK, dV, Amax_dQ, Amax_dK, Amax_dV, Amax_dP)``.

        Give the same mask, scale and ``sink_token`` as the forward whose ``o`` and ``stats``
        are passed. Every scale and descale is a float32 ``[1, 1, 1, 1]`` tensor; the gradients
        are written scaled by ``scale_dQ``/``scale_dK``/``scale_dV`` in q's dtype. Same GPU and
        cuDNN needs as ``sdpa_fp8``, head dims up to 128.

        Args:
            q: the forward's FP8 queries.
            k: the forward's FP8 keys.
            v: the forward's FP8 values.
            o: the forward's FP8 output.
            dO: the output's gradient, FP8.
            stats: the forward's Stats, float32 ``[B, H_q, S_q, 1]``.
            descale_q: q's descale.
            descale_k: k's descale.
            descale_v: v's descale.
            descale_o: o's descale.
            descale_dO: dO's descale.
            descale_s: P's descale.
            descale_dP: dP's descale.
            scale_s: P's scale.
            scale_dQ: dQ's scale.
            scale_dK: dK's scale.
            scale_dV: dV's scale.
            scale_dP: dP's scale.
            use_deterministic_algorithm: ask cuDNN for a deterministic dQ.
            compute_data_type: float32 only.
            name: the node's name.
            dSink_token: a ``[1, H_q, 1, 1]`` float32 tensor the caller made that receives the
                sink's gradient.
            **mask: the mask and scale keywords of ``sdpa``.

        Returns:
            ``(dQ, dK, dV, Amax_dQ, Amax_dK, Amax_dV, Amax_dP)`` handles.
        """
        scales = (descale_q, descale_k, descale_v, descale_o, descale_dO, descale_s, descale_dP, scale_s, scale_dQ,
                  scale_dK, scale_dV, scale_dP)  # fmt: skip
        args = (q, k, v, o, dO, stats, scales, use_deterministic_algorithm, compute_data_type)
        outputs = ("grad_q", "grad_k", "grad_v", *FP8_BACKWARD_AMAXES)
        node = self.recording.record_call(
            Op.BACKWARD, name, FP8_BACKWARD_INPUTS, "sdpa_fp8_backward", _interpret_fp8_backward, args, mask,
            outputs + (("grad_sink",) if dSink_token is not None else ()),
        )  # fmt: skip
        node.fp8 = True
        if dSink_token is not None:
            self.recording.caller_output(node, "grad_sink", dSink_token)
        return tuple(node.outputs[role] for role in outputs)


def _interpret_fp8(recording: Recording, node: Node, mask: dict[str, Any], q: Any, k: Any, v: Any, scales: tuple,
                   is_inference: Any, generate_stats: Any, compute_data_type: Any, fn: Any) -> None:  # fmt: skip
    if fn is not None:  # sdpa_fp8's name for score_mod (interpreted here, at build: the call's key holds both)
        if mask.get("score_mod") is not None:
            node.errors.append("fn: given beside score_mod; sdpa_fp8 takes its score modifier once, as fn")
        mask = {**mask, "score_mod": fn}
    recording.bind_call(node, {"q": q, "k": k, "v": v, **dict(zip(FP8_SCALES, scales))}, mask,
                        "sdpa_fp8")  # fmt: skip
    stats_requested(is_inference, generate_stats, node.errors)
    check_compute_dtype(compute_data_type, node)


def _interpret_fp8_backward(recording: Recording, node: Node, mask: dict[str, Any], q: Any, k: Any, v: Any, o: Any, d_o: Any,
                            stats: Any, scales: tuple, deterministic: Any, compute_data_type: Any) -> None:  # fmt: skip
    modifiers = [keyword for keyword in ("score_mod", "score_mod_bprop") if mask.get(keyword) is not None]
    node.errors += [f"{keyword}: not a keyword of sdpa_fp8_backward (the frontend's FP8 backward takes no score "
                    "modifier)" for keyword in modifiers]  # fmt: skip
    mask = {k: v for k, v in mask.items() if k not in modifiers}
    tensors = {
        "q": q,
        "k": k,
        "v": v,
        "o": o,
        "grad_o": d_o,
        "stats": stats,
        **dict(zip(FP8_BACKWARD_SCALES, scales)),
    }
    recording.bind_call(node, tensors, mask, "sdpa_fp8_backward")
    check_compute_dtype(compute_data_type, node)
    if deterministic is not None and (not isinstance(deterministic, (bool, int)) or deterministic not in (0, 1)):
        node.errors.append(f"use_deterministic_algorithm: {deterministic!r}; expected True or False")
    node.deterministic = deterministic is True or deterministic == 1
