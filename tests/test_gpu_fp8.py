"""FP8 attention on cuDNN against the reference backend's emulation of the same op (same FP8
inputs and scales), and ``cudnn_attn.sdpa_fp8`` against float64 attention.

cuDNN's kernel quantises P per block of keys during its online softmax, the emulation after
the whole row's softmax (both as NVIDIA's own references do), so FP8 outputs agree to within
a few FP8 steps, not bit for bit; stats are computed in float32 by both and agree closely."""

from __future__ import annotations

import pytest
import torch
from conftest import poisoned, rel_err

import cudnn_attn
from cudnn_attn.ops.reference import fp8 as reference_fp8

pytestmark = pytest.mark.gpu

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to("cuda")


def _quantised(x, dtype=E4M3):
    scale = (reference_fp8.fp8_max(dtype) / x.abs().max()).reshape(1, 1, 1, 1).float()
    return reference_fp8.quantise(x.float(), scale, dtype), 1.0 / scale


def _poisoned(handle):
    """An output buffer full of NaN (0xFF is NaN in both FP8 formats), so unwritten elements show."""
    if handle.spec.dtype not in (E4M3, E5M2):
        return poisoned(handle)
    t = torch.empty_strided(handle.spec.shape, handle.spec.stride, dtype=handle.spec.dtype, device="cuda")
    t.view(torch.uint8).fill_(0xFF)
    return t


def _forward_inputs(b=2, h=8, h_kv=8, s=256, d=128, seed=0):
    (q, dq), (k, dk), (v, dv) = (
        _quantised(_randn(b, heads, s, d, seed=seed + i)) for i, heads in enumerate((h, h_kv, h_kv))
    )
    scale_s = torch.full((1, 1, 1, 1), 448.0, device="cuda")
    scale_o = 1.0 / dv
    return (q, k, v, dq, dk, dv, 1.0 / scale_s, scale_s, scale_o)


def _graphs(record):
    built = []
    for backend in ("cudnn", "reference"):
        with cudnn_attn.Graph(backend=backend, cache=cudnn_attn.PlanCache()) as g:
            record(g)
        built.append(g)
    assert built[0].nodes[0].backend == "cudnn"
    return built


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("h_kv", [8, 2], ids=["mha", "gqa"])
def test_forward_matches_the_emulation(causal, h_kv):
    args = _forward_inputs(h_kv=h_kv)
    fast, ref = _graphs(lambda g: g.sdpa_fp8(*args, generate_stats=True, use_causal_mask=causal))
    outs = tuple(_poisoned(h) for h in fast.outputs)
    o, stats, amax_s, amax_o = fast(*args, out=outs)
    o_ref, stats_ref, amax_s_ref, amax_o_ref = ref(*args)
    torch.cuda.synchronize()
    scale_o = args[8]
    # Within an FP8 step or so per element: the kernel and the emulation quantise P in different
    # orders (measured 4.9% on the first run; NVIDIA's own FP8 tests allow rtol 0.2, atol 0.08).
    assert rel_err(o.float() / scale_o, o_ref.float() / scale_o) < 0.08
    assert rel_err(stats, stats_ref) < 1e-3
    assert rel_err(amax_o, amax_o_ref) < 0.05
    assert 0 < float(amax_s) <= 1.0 + 1e-6  # max of a softmax (the kernel's own P)


@pytest.mark.parametrize("d_qk", [144, 192], ids=["d144", "deepseek-d192"])
def test_forward_with_wider_qk_heads_matches_the_emulation(d_qk):
    """d_qk above 128 with d_v 128 (DeepSeek's 192/128), as the frontend's own FP8 tests run it."""
    (q, dq), (k, dk) = (_quantised(_randn(2, 8, 256, d_qk, seed=40 + i)) for i in range(2))
    v, dv = _quantised(_randn(2, 8, 256, 128, seed=42))
    scale_s = torch.full((1, 1, 1, 1), 448.0, device="cuda")
    args = (q, k, v, dq, dk, dv, 1.0 / scale_s, scale_s, 1.0 / dv)
    fast, ref = _graphs(lambda g: g.sdpa_fp8(*args, generate_stats=True, use_causal_mask=True))
    o, stats, _, amax_o = fast(*args, out=tuple(_poisoned(h) for h in fast.outputs))
    o_ref, stats_ref, _, amax_o_ref = ref(*args)
    torch.cuda.synchronize()
    assert rel_err(o.float() * dv, o_ref.float() * dv) < 0.08
    assert rel_err(stats, stats_ref) < 1e-3 and rel_err(amax_o, amax_o_ref) < 0.05


def test_backward_matches_the_emulation():
    args = _forward_inputs(seed=10)
    q, k, v, dq_, dk_, dv_, descale_s, scale_s, scale_o = args
    (ref_forward,) = _graphs(lambda g: g.sdpa_fp8(*args, generate_stats=True, use_causal_mask=True))[1:]
    o, stats, _, _ = ref_forward(*args)
    d_o, descale_do = _quantised(_randn(*q.shape, seed=20), E5M2)
    scale_dp = torch.full((1, 1, 1, 1), 2.0**12, device="cuda")
    unit = torch.ones(1, 1, 1, 1, device="cuda")
    scales = (
        dq_,
        dk_,
        dv_,
        1.0 / scale_o,
        descale_do,
        descale_s,
        1.0 / scale_dp,
        scale_s,
        64 * unit,
        64 * unit,
        64 * unit,
        scale_dp,
    )
    fast, ref = _graphs(lambda g: g.sdpa_fp8_backward(q, k, v, o, d_o, stats, *scales, use_causal_mask=True))
    got = fast(q, k, v, o, d_o, stats, *scales, out=tuple(_poisoned(h) for h in fast.outputs))
    expected = ref(q, k, v, o, d_o, stats, *scales)
    torch.cuda.synchronize()
    for name, a, b in zip(("dQ", "dK", "dV"), got[:3], expected[:3]):
        assert rel_err(a.float(), b.float()) < 0.1, name
    for name, a, b in zip(("Amax_dQ", "Amax_dK", "Amax_dV", "Amax_dP"), got[3:], expected[3:]):
        assert rel_err(a, b) < 0.1, name


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_fp8_on_cudnn_within_fp8_error(causal):
    q, k, v = (_randn(2, 8, 512, 128, seed=30 + i).to(torch.bfloat16).requires_grad_() for i in range(3))
    out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=causal)
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    assert out.dtype == torch.bfloat16 and rel_err(out, expected) < 0.065
    d_out = _randn(*q.shape, seed=40).to(torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), d_out)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    reference = torch.autograd.grad(cudnn_attn.sdpa(*leaves, is_causal=causal), leaves, d_out)
    for a, b in zip(grads, reference):
        # Gradients from the bf16 inputs, as documented; equal up to the order of cuDNN's atomic
        # dQ accumulation (the backward is not deterministic by default).
        assert rel_err(a, b) < 1e-2


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_fp8_tensors_in_and_out_on_cudnn(causal):
    # Fp8Tensor inputs skip the casts: the same FP8 data as the 16-bit path quantises gives the
    # same O on cuDNN as that path, and O within FP8 error of float64 attention, in FP8 or dequantised.
    q, k, v = (_randn(2, 8, 512, 128, seed=60 + i).to(torch.bfloat16) for i in range(3))
    fp8 = [cudnn_attn.Fp8Tensor.quantise(x) for x in (q, k, v)]
    out = cudnn_attn.sdpa_fp8(*fp8, is_causal=causal)
    assert isinstance(out, cudnn_attn.Fp8Tensor) and out.data.is_cuda and out.data.dtype == E4M3
    expected = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)
    assert rel_err(out.dequantise(), expected) < 0.065
    dequantised = cudnn_attn.sdpa_fp8(*fp8, is_causal=causal, out_dtype=torch.bfloat16)
    assert torch.equal(dequantised, out.dequantise(torch.bfloat16))
    assert torch.equal(dequantised, cudnn_attn.sdpa_fp8(q, k, v, is_causal=causal))
    from_16_bit = cudnn_attn.sdpa_fp8(q, k, v, is_causal=causal, out_dtype=E4M3)
    assert torch.equal(from_16_bit.data.view(torch.uint8), out.data.view(torch.uint8))


def test_fp8_plans_are_autotuned_stored_and_loaded(tmp_path):
    args = _forward_inputs(seed=50)
    runs = []
    for _ in range(2):  # the second cache loads what the first stored
        with cudnn_attn.Graph(autotune=True, cache=cudnn_attn.PlanCache(path=tmp_path)) as g:
            g.sdpa_fp8(*args, use_causal_mask=True)
        runs.append((g.nodes[0].plan.source, g(*args)))
    assert [source for source, _ in runs] == ["built", "disk"]
    (_, first), (_, second) = runs
    assert torch.equal(first[0].float(), second[0].float())  # one plan, one result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_casts_equal_the_float32_arithmetic(dtype):
    """The one-pass CUDA kernels give exactly the values of the float32 torch arithmetic the CPU
    runs (saturation included), for contiguous and strided inputs."""
    from cudnn_attn.kernels import fp8_cast

    x = (_randn(2, 300, 8, 64, seed=60) * 3).to(dtype).transpose(1, 2)  # a BSHD view: strided
    for scale in (torch.tensor(40.0), torch.tensor(900.0)):  # in range; far past 448 (saturates)
        scale = scale.reshape(1, 1, 1, 1).cuda()
        fused = fp8_cast.to_fp8(x, scale)
        expected = (x.float() * scale).clamp(-448, 448).to(E4M3)
        assert fused.shape == x.shape and torch.equal(fused.float(), expected.float())
        back = fp8_cast.from_fp8(fused, 1.0 / scale, dtype)
        assert torch.equal(back, (fused.float() * (1.0 / scale)).to(dtype))


def test_one_launch_casts_of_q_k_v_equal_the_cpu_arithmetic():
    """quantise_qkv / amax_qkv / advance_history on CUDA give exactly the values of the torch
    float32 arithmetic the CPU runs: GQA sizes, a strided (BSHD) view kept in its own order,
    scales from amaxes or from a buffer, amaxes recorded in the pass."""
    from cudnn_attn.kernels import fp8_cast

    q = (_randn(2, 300, 8, 64, seed=61) * 3).to(torch.bfloat16).transpose(1, 2)  # BSHD view
    k, v = ((_randn(2, 2, 300, 64, seed=62 + i) * (1 + 40 * i)).to(torch.bfloat16) for i in range(2))
    tensors, on_cpu = (q, k, v), tuple(x.cpu() for x in (q, k, v))
    amaxes = fp8_cast.amax_qkv(tensors)
    assert torch.equal(amaxes.cpu(), fp8_cast.amax_qkv(on_cpu))
    got, used, descales = fp8_cast.quantise_qkv(tensors, amaxes=amaxes)
    want, want_used, want_descales = fp8_cast.quantise_qkv(on_cpu, amaxes=amaxes.cpu())
    assert got[0].stride() == q.stride()  # cast in its own memory order, no copy
    for a, b in zip(got, want):
        assert torch.equal(a.cpu().float(), b.float())
    assert torch.equal(used[:, 0].cpu(), want_used[:, 0]) and torch.equal(descales[:, 0].cpu(), want_descales[:, 0])
    scales = fp8_cast.scale_buffer("cuda", 900.0)  # saturates every tensor
    record = torch.zeros(3, device="cuda")
    got, _, _ = fp8_cast.quantise_qkv(tensors, scales=scales, record=record)
    want, _, _ = fp8_cast.quantise_qkv(on_cpu, scales=scales.cpu(), record=torch.zeros(3))
    assert all(torch.equal(a.cpu().float(), b.float()) for a, b in zip(got, want))
    assert torch.equal(record.cpu(), amaxes.cpu())
    history, slot = torch.rand(3, 5, device="cuda"), torch.tensor([3], dtype=torch.int32, device="cuda")
    cpu_state = [history.cpu(), record.cpu(), slot.cpu(), scales.cpu()]
    fp8_cast.advance_history(history, record, slot, scales)
    fp8_cast.advance_history(*cpu_state)
    for a, b in zip((history, record, slot, scales[:, 0]), (*cpu_state[:3], cpu_state[3][:, 0])):
        assert torch.equal(a.cpu(), b)


def test_delayed_scaling_captured_in_a_cuda_graph_advances_per_replay():
    """After one eager call, sdpa_fp8 with an Fp8Scaling is captured; each replay on new
    inputs gives what the same sequence of eager calls gives, history included."""
    shape = (1, 8, 256, 128)
    captured, eager = cudnn_attn.Fp8Scaling(history=2), cudnn_attn.Fp8Scaling(history=2)
    steps = [[(_randn(*shape, seed=100 + 3 * i + j) * (1 + i)).to(torch.bfloat16) for j in range(3)] for i in range(4)]
    static = [x.clone() for x in steps[0]]
    cudnn_attn.sdpa_fp8(*static, is_causal=True, scaling=captured)  # the first call, eager
    cudnn_attn.sdpa_fp8(*steps[0], is_causal=True, scaling=eager)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cudnn_attn.sdpa_fp8(*static, is_causal=True, scaling=captured)
    for inputs in steps[1:]:
        for dst, src in zip(static, inputs):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        expected = cudnn_attn.sdpa_fp8(*inputs, is_causal=True, scaling=eager)
        assert torch.equal(out, expected)
    assert torch.equal(captured.amaxes, eager.amaxes)


def test_delayed_scaling_records_amaxes_in_the_cast_and_matches_current_scaling():
    """On CUDA the one-pass cast records each tensor's amax (atomic max in the kernel)."""
    scaling = cudnn_attn.Fp8Scaling(history=4)
    q, k, v = (_randn(2, 8, 512, 128, seed=70 + i).to(torch.bfloat16) for i in range(3))
    for _ in range(3):  # steady inputs: the history's scale is the current one
        out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=True, scaling=scaling)
    assert torch.equal(out, cudnn_attn.sdpa_fp8(q, k, v, is_causal=True))
    for i, x in enumerate((q, k, v)):
        assert torch.equal(scaling.amaxes[i, 2], x.abs().max().float())


def test_fp8_backward_on_cudnn_close_to_bf16_gradients():
    q, k, v = (_randn(2, 8, 512, 128, seed=80 + i).to(torch.bfloat16).requires_grad_() for i in range(3))
    d_out = _randn(2, 8, 512, 128, seed=90).to(torch.bfloat16)
    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    expected = torch.autograd.grad(cudnn_attn.sdpa(*leaves, is_causal=True), leaves, d_out)
    scaling = cudnn_attn.Fp8Scaling()
    for call in range(2):
        out = cudnn_attn.sdpa_fp8(q, k, v, is_causal=True, scaling=scaling, backward="fp8")
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        for got, want in zip(grads, expected):
            assert rel_err(got, want) < 0.12
        assert scaling.grad_calls == call + 1  # the first backward measures its amaxes once, recording one entry


def test_a_retained_fp8_backward_on_cudnn_runs_again_with_the_same_gradients():
    q, k, v = (_randn(1, 8, 256, 128, seed=100 + i).to(torch.bfloat16).requires_grad_() for i in range(3))
    d_out = _randn(1, 8, 256, 128, seed=110).to(torch.bfloat16)
    scaling = cudnn_attn.Fp8Scaling()
    out = cudnn_attn.sdpa_fp8(q, k, v, scaling=scaling, backward="fp8")
    first = torch.autograd.grad(out, (q, k, v), d_out, retain_graph=True)
    calls = scaling.grad_calls
    again = torch.autograd.grad(out, (q, k, v), d_out)
    for a, b in zip(first, again):
        assert rel_err(a, b) < 1e-2  # the same scales; only the kernel's accumulation order may differ
    assert scaling.grad_calls == calls
