"""``kernels.launch.Launcher``: the direct launch gives the JIT call's results for every argument
specialisation, and a new specialisation compiles rather than reusing a kernel made for another."""

import pytest
import torch

from cudnn_attn.kernels import launch as launch_module
from cudnn_attn.kernels.launch import Launcher, _kind

gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_the_key_tells_apart_what_triton_specialises_on():
    x = torch.zeros(64)
    assert _kind(x) != _kind(x[1:])  # 16-byte aligned or not
    assert _kind(x) != _kind(x.half())
    assert len({_kind(1), _kind(2), _kind(16), _kind(2**31), _kind(2**63)}) == 5
    assert _kind(3) == _kind(5) and _kind(32) == _kind(48)  # same specialisation: one compiled kernel
    assert _kind(0.5) == _kind(2.0) and _kind(True) != _kind(False) and _kind(None) != _kind(False)


def _axpy():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def axpy(x_ptr, y_ptr, out_ptr, n, stride, a, BLOCK: tl.constexpr, NEGATE: tl.constexpr):  # noqa: N803
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = i < n
        x = tl.load(x_ptr + i * stride, mask=inside)
        y = tl.load(y_ptr + i * stride, mask=inside)
        r = a * x + y
        tl.store(out_ptr + i * stride, -r if NEGATE else r, mask=inside)

    return Launcher(axpy)


class _NoJitCall:
    """A kernel whose JIT call fails: a launch that reaches it did not take the direct path."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        raise AssertionError("went through Triton's JIT call")


@gpu
@needs_gpu
def test_direct_launches_match_torch_across_specialisations():
    launch = _axpy()
    base = torch.randn(4099, device="cuda")
    other = torch.randn(4099, device="cuda")
    cases = [  # (offset, n, stride, a, negate): alignment, n == 1, stride 1 / 2, the constexpr
        (0, 4096, 1, 0.5, False),
        (0, 4096, 1, -2.0, False),
        (1, 4000, 1, 0.5, False),
        (0, 1, 1, 3.0, False),
        (0, 2000, 2, 0.25, False),
        (3, 999, 2, 1.5, True),
        (0, 4096, 1, 0.5, True),
        (0, 4096, 1, 0.75, False),
    ]
    for rounds in range(2):  # the second pass runs every case on a kernel kept from the first
        if rounds:
            launch.kernel = _NoJitCall(launch.kernel)
        for offset, n, stride, a, negate in cases:
            x, y = base[offset:], other[offset:]
            out = torch.full_like(x, float("nan"))
            launch((-(-n // 256),), x, y, out, n, stride, a, BLOCK=256, NEGATE=negate)
            want = a * x[: n * stride : stride] + y[: n * stride : stride]
            torch.testing.assert_close(out[: n * stride : stride], -want if negate else want)
    # A kind per tensor alignment, integer value and constexpr (floats are one kind).
    assert len(launch._compiled) == len({(o % 4 == 0, n, stride, negate) for o, n, stride, _, negate in cases})


@gpu
@needs_gpu
def test_integers_of_every_value_launch_right_and_the_kinds_kept_stay_bounded(monkeypatch):
    """Integers key by value: sizes that change call after call each launch right, and the
    table of kinds starts afresh at its bound instead of growing."""
    monkeypatch.setattr(launch_module, "MAX_KINDS", 4)
    launch = _axpy()
    x, y = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
    for n in (4096, 17, 1, 1000, 3001, 16, 4096, 2048, 99):
        out = torch.full_like(x, float("nan"))
        launch((-(-n // 256),), x, y, out, n, 1, 0.5, BLOCK=256, NEGATE=False)
        torch.testing.assert_close(out[:n], 0.5 * x[:n] + y[:n])
        assert out[n:].isnan().all()
        assert len(launch._compiled) <= 4


@gpu
@needs_gpu
def test_a_launch_runs_on_the_device_and_stream_of_its_tensors():
    launch = _axpy()
    x = torch.randn(1024, device="cuda")
    stream = torch.cuda.Stream()
    for _ in range(3):
        out = torch.full_like(x, float("nan"))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000)  # a launch on the default stream would run before this ends
            launch((4,), x, x, out, 1024, 1, 2.0, BLOCK=256, NEGATE=False)
            done = out.clone()
        torch.cuda.current_stream().wait_stream(stream)
        torch.testing.assert_close(done, 3 * x)
