"""Block outputs merged into the whole row's output as they arrive, by log-sum-exp, in float32.

Each ring step gives a partial ``(o_i, lse_i)`` for some query rows, normalised over the
step's keys only. Keeping a running ``(O, L)`` instead of every partial bounds memory to one
float32 output whatever the ring length. Per step, as plain torch::

    L_new = logaddexp(L, lse_i)
    O = O * exp(L - L_new) + o_i * exp(lse_i - L_new);  L = L_new

Rows no block has reached keep ``O = 0``, ``L = -inf`` (never NaN: the exponent's base is 0
where ``L_new`` is -inf).
"""

from __future__ import annotations

import torch


class RunningOutput:
    """The float32 output and LSE of ``[B, H, S, ·]`` query rows, merged block by block.

    Example::

        acc = RunningOutput(q.shape[:3], d_v, q.device)
        acc.add(slice(None), o_0, lse_0)          # every row
        acc.add(slice(half, None), o_1, lse_1)    # the second half only
        out, lse = acc.result(torch.bfloat16)
    """

    def __init__(self, rows_shape: tuple[int, ...] | torch.Size, d_v: int, device: torch.device):
        b, h, s = rows_shape
        self.out = torch.zeros(b, h, s, d_v, dtype=torch.float32, device=device)
        self.lse = torch.full((b, h, s, 1), float("-inf"), dtype=torch.float32, device=device)
        self._empty = True

    def add(self, rows: slice, o: torch.Tensor, lse: torch.Tensor) -> None:
        if self._empty and rows == slice(None):  # the first block of every row: nothing to rescale
            self.out.copy_(o)
            self.lse.copy_(lse)
            self._empty = False
            return
        self._empty = False
        out, old = self.out[:, :, rows], self.lse[:, :, rows]
        new = torch.logaddexp(old, lse)
        base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
        out.mul_(torch.exp(old - base)).add_(o * torch.exp(lse - base))
        old.copy_(new)

    def result(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out in dtype, lse in float32)``, both contiguous."""
        return self.out.to(dtype), self.lse
