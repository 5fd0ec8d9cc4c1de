"""``bench.paused_timing``: one call's kernel time after a pause, as the frontend's training
benchmark times it, counts every kernel of the call and only those."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def test_paused_kernel_time_counts_every_kernel_of_the_call():
    from cudnn_attn.bench.paused_timing import paused_kernel_ms

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    out = torch.empty_like(a)

    def once() -> None:
        torch.matmul(a, b, out=out)

    def twice() -> None:
        torch.matmul(a, b, out=out)
        torch.matmul(b, a, out=out)

    times = paused_kernel_ms({"once": once, "twice": twice}, iterations=6)
    assert set(times) == {"once", "twice"}
    assert 0.01 < times["once"]["ms"] < 50
    assert 1.6 < times["twice"]["ms"] / times["once"]["ms"] < 2.4
