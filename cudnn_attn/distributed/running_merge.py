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
from ..kernels.row_merge import add_rows, as_rows, merge_rows


class RunningOutput:
    """The float32 output and LSE of query rows, merged block by block. ``rows_shape``: the
    output's shape less its head dim (``[B, H, S]`` dense, ``[T, H]`` packed); ``seq_dim``: the
    dimension blocks select rows along, by a slice (a view) or an int64 index (packed rows).
    Each merge is one pass over the block's rows (``kernels.row_merge``); the first block that
    covers every row is written without a fill.

    Example::

        acc = RunningOutput(q.shape[:3], d_v, q.device)
        acc.add(slice(None), o_0, lse_0)          # every row
        acc.add(slice(half, None), o_1, lse_1)    # the second half only
        out, lse = acc.result(torch.bfloat16)
    """

    def __init__(self, rows_shape: tuple[int, ...] | torch.Size, d_v: int, device: torch.device, seq_dim: int = 2):
        self.out = torch.empty(*rows_shape, d_v, dtype=torch.float32, device=device)
        self.lse = torch.empty((*rows_shape, 1), dtype=torch.float32, device=device)
        self.seq_dim = seq_dim
        self._empty = True

    def place(self, call: object) -> None:
        """Where the next block writes its output: its own tensor (merged into this one)."""
        return None

    def add(self, rows: slice | torch.Tensor, o: torch.Tensor, lse: torch.Tensor) -> None:
        every = isinstance(rows, slice) and rows == slice(None)
        if self._empty and not every:  # rows no block reaches yet: O = 0, L = -inf
            self.out.zero_()
            self.lse.fill_(float("-inf"))
        at = rows if isinstance(rows, torch.Tensor) else rows.indices(self.out.shape[self.seq_dim])[0]
        out, lse_rows = self._rows(self.out), self._rows(self.lse)[..., 0]
        merge_rows(out, lse_rows, self._rows(o), self._rows(lse)[..., 0], at, first=self._empty)
        self._empty = False

    def _rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as ``[B, H, S, ·]``: packed ``[T, H, ·]`` is ``[1, H, T, ·]``."""
        return t if self.seq_dim == 2 else as_rows(t)

    def result(self, dtype: torch.dtype, sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out in dtype, lse in float32)``, both contiguous; ``sink`` (float32, broadcasting
        to the LSE) is one more term of every row's denominator, weighing no value."""
        if self._empty:  # no block at all
            self.out.zero_()
            self.lse.fill_(float("-inf"))
            self._empty = False
        if sink is not None:
            add_sink(self.out, self.lse, sink)
        return self.out.to(dtype), self.lse


class RunningGrads:
    """Query gradients added block by block into a float32 ``[B, H, S, D]`` (dense shards,
    whose blocks select rows by slices); ``result`` rounds them once.

    Example::

        d_q = RunningGrads(q.shape, q.device)
        d_q.add(slice(half, None), dq_half)
        total = d_q.result(q.dtype)
    """

    def __init__(self, shape: tuple[int, ...] | torch.Size, device: torch.device):
        self.d_q = torch.zeros(shape, dtype=torch.float32, device=device)

    def place(self, call: object) -> None:
        return None

    def add(self, rows: slice | torch.Tensor, grad: torch.Tensor) -> None:
        add_rows(self.d_q, grad, rows if isinstance(rows, torch.Tensor) else rows.indices(self.d_q.shape[2])[0])

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        return self.d_q.to(dtype)
