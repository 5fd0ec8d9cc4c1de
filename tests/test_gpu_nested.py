"""``cudnn_attn.sdpa`` on jagged nested tensors on cuDNN, against the reference backend (the same
inputs on the CPU): outputs and gradients. The library allocates these outputs itself (zero-filled
by the varlen door), so they cannot be poisoned: a row cuDNN leaves unwritten shows as zeros
against the reference's values, and every result must be finite."""

from __future__ import annotations

import pytest
import torch
from conftest import rel_err

import cudnn_attn

pytestmark = pytest.mark.gpu

TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _packed(lengths, heads, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lengths), heads, d, generator=gen).to(dtype)


def _offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _run(device, lq, lkv, h, h_kv, d_qk, d_v, dtype, causal, seed):
    """Output values and q/k/v gradients (packed) of one nested call on ``device``."""
    off_q, off_kv = _offsets(lq).to(device), _offsets(lkv).to(device)
    q_leaf, k_leaf, v_leaf = (
        _packed(lengths, heads, d, dtype, seed + i).to(device).requires_grad_()
        for i, (lengths, heads, d) in enumerate(((lq, h, d_qk), (lkv, h_kv, d_qk), (lkv, h_kv, d_v)))
    )
    q = torch.nested.nested_tensor_from_jagged(q_leaf, off_q, max_seqlen=max(lq)).transpose(1, 2)
    k, v = (
        torch.nested.nested_tensor_from_jagged(t, off_kv, max_seqlen=max(lkv)).transpose(1, 2) for t in (k_leaf, v_leaf)
    )
    out = cudnn_attn.sdpa(q, k, v, is_causal=causal, enable_gqa=h_kv != h)
    assert out.is_nested and out.device.type == torch.device(device).type
    values = out.transpose(1, 2).values()
    values.backward(_packed(lq, h, d_v, dtype, seed + 10).to(device))
    return [t.detach().cpu() for t in (values, q_leaf.grad, k_leaf.grad, v_leaf.grad)]


CASES = {
    # name: (q lengths, kv lengths, H, H_kv, d_qk, d_v)
    "self": ([37, 128, 1, 90], None, 8, 8, 128, 128),
    "gqa": ([37, 128, 1, 90], None, 8, 2, 128, 128),
    "cross-gqa": ([1, 64, 200], [300, 17, 5], 8, 2, 64, 64),
    "dv": ([33, 1, 70], [50, 9, 70], 4, 4, 128, 64),
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_cudnn_matches_the_reference(case, dtype, causal):
    lq, lkv, h, h_kv, d_qk, d_v = case
    args = (lq, lkv or lq, h, h_kv, d_qk, d_v, dtype, causal, 100 + len(lq))
    try:
        got = _run("cuda", *args)
    except cudnn_attn.UnsupportedError as error:  # a limit of this GPU / cuDNN (d_qk != d_v), not a wrong answer
        pytest.skip(str(error))
    torch.cuda.synchronize()
    expected = _run("cpu", *args)
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, expected):
        assert torch.isfinite(g).all(), name
        assert rel_err(g, e) < TOL[dtype], name


def test_a_second_packing_reuses_the_plans_and_stays_right():
    """New lengths in the same buckets: the run must follow the new offsets, not the first call's."""
    first = _run("cuda", [20, 5], [20, 5], 4, 4, 64, 64, torch.bfloat16, True, 1)
    second = _run("cuda", [3, 30], [9, 30], 4, 4, 64, 64, torch.bfloat16, True, 2)
    expected = _run("cpu", [3, 30], [9, 30], 4, 4, 64, 64, torch.bfloat16, True, 2)
    assert rel_err(first[0], _run("cpu", [20, 5], [20, 5], 4, 4, 64, 64, torch.bfloat16, True, 1)[0]) < 1.6e-2
    for g, e in zip(second, expected):
        assert rel_err(g, e) < 1.6e-2


def test_a_cached_max_seqlen_costs_no_host_sync():
    """With torch's cached longest length and one offsets tensor for k and v, a warm inference call
    never waits for the GPU."""
    lengths = [17, 64, 3]
    offsets = _offsets(lengths).cuda()
    q, k, v = (
        torch.nested.nested_tensor_from_jagged(
            _packed(lengths, 4, 64, torch.float16, s).cuda(), offsets, max_seqlen=64
        ).transpose(1, 2)
        for s in range(3)
    )
    with torch.no_grad():
        cudnn_attn.sdpa(q, k, v, is_causal=True)  # builds the plans
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = cudnn_attn.sdpa(q, k, v, is_causal=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    expected = cudnn_attn.sdpa(*(t.cpu() for t in (q, k, v)), is_causal=True)
    assert rel_err(out.transpose(1, 2).values(), expected.transpose(1, 2).values()) < TOL[torch.float16]
