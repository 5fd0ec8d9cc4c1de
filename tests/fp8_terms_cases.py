"""FP8 attention cases with sinks and soft-capping, and their float64 oracle: FP8 inputs made by
current scaling from random normals, every scale a float32 [1, 1, 1, 1] tensor. Shared by the
CPU tests (reference backend) and the GPU tests (cuDNN)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cudnn_attn.ops.reference import fp8 as reference_fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
B, H, S, D = 2, 4, 128, 128  # Hopper's FP8 backward takes head dim 128 only
CAP = 5.0


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _scale(x: torch.Tensor, dtype=E4M3) -> torch.Tensor:
    """The scale that maps ``x``'s amax to the format's largest value (current scaling)."""
    return (reference_fp8.fp8_max(dtype) / x.abs().max()).float().reshape(1, 1, 1, 1)


def _quantised(x: torch.Tensor, dtype=E4M3) -> tuple[torch.Tensor, torch.Tensor]:
    scale = _scale(x, dtype)
    return reference_fp8.quantise(x.float(), scale, dtype), 1.0 / scale


def oracle(q, k, v, *, sink, causal, softcap=None):
    """float64 attention (O, LSE): GQA by repetition, a sink as one more score weighing no value."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.expand(*s.shape[:-1], 1)], -1)
        return torch.softmax(s, -1)[..., :-1] @ v, torch.logsumexp(s, -1, keepdim=True)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1, keepdim=True)


@dataclass
class ForwardCase:
    args: tuple  # sdpa_fp8's positional arguments: q, k, v, then its six scales
    sink: torch.Tensor  # float32 [1, H, 1, 1]
    scale_o: torch.Tensor


def forward_case(
    device: str, *, h_kv: int = H, causal: bool = True, sink: bool = True, spread: float = 1.0, seed: int = 0
) -> ForwardCase:
    q = _randn(B, H, S, D, seed=seed) * spread
    k, v = _randn(B, h_kv, S, D, seed=seed + 1), _randn(B, h_kv, S, D, seed=seed + 2)
    (q8, dq), (k8, dk), (v8, dv) = (_quantised(x) for x in (q, k, v))
    scale_s = torch.full((1, 1, 1, 1), 448.0)
    scale_o = _scale(v8.double() * dv.double())  # |O| <= max |V|: no saturation
    sinks = (4.5 + 0.5 * _randn(1, H, 1, 1, seed=seed + 3)).float()  # a share of each row comparable to the keys'
    args = tuple(t.to(device) for t in (q8, k8, v8, dq, dk, dv, 1.0 / scale_s, scale_s, scale_o))
    return ForwardCase(args=args, sink=sinks.to(device) if sink else None, scale_o=scale_o.to(device))


def dequantised(case: ForwardCase) -> tuple[torch.Tensor, ...]:
    q8, k8, v8, dq, dk, dv = case.args[:6]
    return tuple(x8.double() * s.double() for x8, s in ((q8, dq), (k8, dk), (v8, dv)))


@dataclass
class BackwardCase:
    args: tuple  # sdpa_fp8_backward's positional arguments
    sink: torch.Tensor
    grad_scales: tuple  # scale_dQ, scale_dK, scale_dV
    want_grads: tuple  # float64 dQ, dK, dV of the dequantised inputs
    want_d_sink: torch.Tensor


def backward_case(device: str, seed: int = 5) -> BackwardCase:
    """A causal FP8 backward with a sink: O and the stats from the float64 forward (O quantised),
    dO random in E5M2, the gradients' scales from the float64 gradients."""
    fwd = forward_case("cpu", causal=True, sink=True, seed=seed)
    leaves = [t.clone().requires_grad_() for t in (*dequantised(fwd), fwd.sink.double())]
    o, lse = oracle(*leaves[:3], sink=leaves[3], causal=True)
    o8, descale_o = _quantised(o.detach())
    do8, descale_do = _quantised(_randn(*o.shape, seed=seed + 9), E5M2)
    grads = torch.autograd.grad(o, leaves, do8.double() * descale_do.double())
    q8, k8, v8, dq, dk, dv, descale_s, scale_s, _ = fwd.args
    scale_dp = torch.full((1, 1, 1, 1), 2.0**10)  # dS is small: scaled up into E5M2's range
    grad_scales = tuple(_scale(g) for g in grads[:3])
    args = (
        q8,
        k8,
        v8,
        o8,
        do8,
        lse.detach().float(),
        dq,
        dk,
        dv,
        descale_o,
        descale_do,
        descale_s,
        1.0 / scale_dp,
        scale_s,
        *grad_scales,
        scale_dp,
    )
    return BackwardCase(
        args=tuple(t.to(device) for t in args),
        sink=fwd.sink.to(device),
        grad_scales=tuple(t.to(device) for t in grad_scales),
        want_grads=tuple(g.to(device) for g in grads[:3]),
        want_d_sink=grads[3].to(device),
    )


def softcap_fn(cap):
    """Gemma-2's soft-capping as the frontend writes a score modifier: cap * tanh(s / cap)."""
    return lambda g, s: g.mul(a=g.tanh(input=g.div(a=s, b=cap)), b=cap)
