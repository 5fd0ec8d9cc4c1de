"""An independent, naive float64 attention: row by row, masks written from their definitions.

Shares no code with the library; the reference backend is tested against it.
"""

from __future__ import annotations

import math

import torch


def alibi_slopes(heads: int) -> torch.Tensor:
    # As the cuDNN frontend's own test writes it: powers of m0 = 2^(-8/n), odd extras beyond n.
    n = 2 ** math.floor(math.log2(heads))
    m = torch.pow(torch.tensor(2.0 ** (-8.0 / n), dtype=torch.float64), torch.arange(1, 1 + n))
    if n < heads:
        extra = torch.pow(torch.tensor(2.0 ** (-4.0 / n), dtype=torch.float64), torch.arange(1, 1 + 2 * (heads - n), 2))
        m = torch.cat([m, extra])
    return m


def allowed_row(i, s_kv, len_q, len_kv, causal, window):
    """Which keys row i may see, as a bool vector."""
    j = torch.arange(s_kv)
    ok = torch.ones(s_kv, dtype=torch.bool)
    if i >= len_q:
        return torch.zeros(s_kv, dtype=torch.bool)
    ok &= j < len_kv
    diagonal = i + (len_kv - len_q if causal == "bottom_right" else 0)
    if causal in ("top_left", "bottom_right"):
        ok &= j <= diagonal
    if window is not None:
        ok &= j > diagonal - window
    return ok


def attention(
    q, k, v, *, scale, causal=None, window=None, seq_q=None, seq_kv=None, bias=None, alibi=False, keep=None, p=0.0
):
    """Dense [B, H, S, D] inputs -> (O, LSE) in float64; fully masked rows give (0, -inf)."""
    q, k, v = q.double(), k.double(), v.double()
    b_n, h_q, s_q, _ = q.shape
    h_kv, s_kv, d_v = k.shape[1], k.shape[2], v.shape[3]
    o = torch.zeros(b_n, h_q, s_q, d_v, dtype=torch.float64)
    lse = torch.full((b_n, h_q, s_q, 1), float("-inf"), dtype=torch.float64)
    slopes = alibi_slopes(h_q) if alibi else None
    for b in range(b_n):
        len_q = int(seq_q[b]) if seq_q is not None else s_q
        len_kv = int(seq_kv[b]) if seq_kv is not None else s_kv
        for h in range(h_q):
            g = h // (h_q // h_kv)
            for i in range(s_q):
                ok = allowed_row(i, s_kv, len_q, len_kv, causal, window)
                if not ok.any():
                    continue
                s = (k[b, g] @ q[b, h, i]) * scale
                if bias is not None:
                    s = s + bias.double().expand(b_n, h_q, s_q, s_kv)[b, h, i]
                if slopes is not None:
                    s = s + slopes[h] * (torch.arange(s_kv, dtype=torch.float64) - i)
                s = s[ok]
                m = s.max()
                w = torch.exp(s - m)
                lse[b, h, i, 0] = m + torch.log(w.sum())
                probs = torch.zeros(s_kv, dtype=torch.float64)
                probs[ok] = w / w.sum()
                if keep is not None and p > 0:
                    probs = probs * keep[b, h, i].double() / (1 - p)
                o[b, h, i] = probs @ v[b, g]
    return o, lse


def attention_autograd(q, k, v, *, scale, allowed=None, bias=None, keep=None, p=0.0):
    """Differentiable dense float64 attention (for gradients); ``allowed`` broadcasts to the scores."""
    h_q, h_kv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h_q // h_kv, dim=1)
    v = v.repeat_interleave(h_q // v.shape[1], dim=1)
    s = (q @ k.transpose(-1, -2)) * scale
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = torch.where(allowed, s, torch.full_like(s, -1e30))  # finite: fully masked rows stay differentiable
    probs = torch.softmax(s, -1)
    if allowed is not None:
        probs = probs * allowed
    if keep is not None and p > 0:
        probs = probs * keep / (1 - p)
    return probs @ v


def allowed_matrix(b_n, s_q, s_kv, *, causal=None, window=None, seq_q=None, seq_kv=None):
    rows = []
    for b in range(b_n):
        len_q = int(seq_q[b]) if seq_q is not None else s_q
        len_kv = int(seq_kv[b]) if seq_kv is not None else s_kv
        rows.append(torch.stack([allowed_row(i, s_kv, len_q, len_kv, causal, window) for i in range(s_q)]))
    return torch.stack(rows).unsqueeze(1)
