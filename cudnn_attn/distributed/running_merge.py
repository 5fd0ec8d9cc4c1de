"""Block outputs merged into the whole row's output as they arrive, by log-sum-exp, in float32.

Each ring step gives a partial ``(o_i, lse_i)`` for some query rows, normalised over the
step's keys only. Keeping a running ``(O, L)`` instead of every partial bounds memory to one
float32 output whatever the ring length. Per step, as plain torch::

    L_new = logaddexp(L, lse_i)
    O = O * exp(L - L_new) + o_i * exp(lse_i - L_new);  L = L_new

Rows no block has reached keep ``O = 0``, ``L = -inf`` (never NaN: the exponent's base is 0
where ``L_new`` is -inf). A sink folds in once, after the last block (``core.sink_fold``).
"""

from __future__ import annotations

import torch

from ..core.sink_fold import add_sink


class RunningOutput:
    """The float32 output and LSE of query rows, merged block by block. ``rows_shape``: the
    output's shape less its head dim (``[B, H, S]`` dense, ``[T, H]`` packed); ``seq_dim``: the
    dimension blocks select rows along, by a slice (a view) or an int64 index (packed rows).

    Example::

        acc = RunningOutput(q.shape[:3], d_v, q.device)
        acc.add(slice(None), o_0, lse_0)          # every row
        acc.add(slice(half, None), o_1, lse_1)    # the second half only
        out, lse = acc.result(torch.bfloat16)
    """

    def __init__(self, rows_shape: tuple[int, ...] | torch.Size, d_v: int, device: torch.device, seq_dim: int = 2):
        self.out = torch.zeros(*rows_shape, d_v, dtype=torch.float32, device=device)
        self.lse = torch.full((*rows_shape, 1), float("-inf"), dtype=torch.float32, device=device)
        self.seq_dim = seq_dim
        self._empty = True

    def add(self, rows: slice | torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
        if self._empty and isinstance(rows, slice) and rows == slice(None):  # the first block: nothing to rescale
            self.out.copy_(o)
            self.lse.copy_(lse)
            self._empty = False
            return
        self._empty = False
        if isinstance(rows, torch.Tensor):
            out, old = self.out.index_select(self.seq_dim, rows), self.lse.index_select(self.seq_dim, rows)
        else:
            at = (slice(None),) * self.seq_dim + (rows,)
            out, old = self.out[at], self.lse[at]
        new = torch.logaddexp(old, lse)
        base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
        out.mul_(torch.exp(old - base)).add_(o * torch.exp(lse - base))
        old.copy_(new)
        if isinstance(rows, torch.Tensor):  # merged in a copy: written back
            self.out.index_copy_(self.seq_dim, rows, out)
            self.lse.index_copy_(self.seq_dim, rows, old)

    def result(self, dtype: torch.dtype, sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out in dtype, lse in float32)``, both contiguous; ``sink`` (float32, broadcasting
        to the LSE) is one more term of every row's denominator, weighing no value."""
        if sink is not None:
            add_sink(self.out, self.lse, sink)
        return self.out.to(dtype), self.lse
