"""``cudnn_attn.backend(name)``: the backend for a block of code. Nesting, restoring after an
exception, threads, every door honouring it, and the caches in front of plans never crossing
backends (on the CPU, a plan cached under "auto" must not serve a call under "cudnn")."""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import pytest
import torch
from conftest import randn, rel_err

import cudnn_attn
from cudnn_attn.errors import UnsupportedError, ValidationError
from cudnn_attn.runtime import backend_choice, prepared
from cudnn_attn.runtime.backend_choice import chosen


def qkv(seed=0, shape=(1, 2, 16, 32), device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return tuple(randn(*shape, generator=gen, device=device) for _ in range(3))


def packed(device="cpu"):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(12, 2, 32, generator=gen, device=device) for _ in range(3))
    return q, k, v, torch.tensor([0, 5, 12], dtype=torch.int32, device=device)


def float64_attention(q, k, v, causal=False):
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), -math.inf)
    return torch.softmax(s, dim=-1) @ v.double()


def test_blocks_nest_and_restore():
    assert chosen() == "auto"
    with cudnn_attn.backend("reference"):
        assert chosen() == "reference"
        with cudnn_attn.backend("cudnn"):
            assert chosen() == "cudnn"
        assert chosen() == "reference"
    assert chosen() == "auto"


def test_the_choice_is_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="inside"):
        with cudnn_attn.backend("reference"):
            with cudnn_attn.backend("cudnn"):
                raise RuntimeError("inside")
    assert chosen() == "auto"


def test_works_as_a_decorator():
    @cudnn_attn.backend("reference")
    def inside():
        return chosen()

    assert inside() == "reference" and chosen() == "auto"


@pytest.mark.parametrize("name", ["cuda", "", None, "Reference"])
def test_a_name_that_is_no_backend_is_refused(name):
    with pytest.raises(ValidationError, match=r"backend: name: .*allowed 'auto', 'cudnn', 'reference'"):
        with cudnn_attn.backend(name):
            pass


def test_each_thread_has_its_own_choice():
    seen: dict[str, str] = {}
    both_inside = threading.Barrier(2)

    def worker(name):
        with cudnn_attn.backend(name):
            both_inside.wait(timeout=10)  # both blocks are open at once
            seen[name] = chosen()
            both_inside.wait(timeout=10)

    threads = [threading.Thread(target=worker, args=(n,)) for n in ("reference", "cudnn")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"reference": "reference", "cudnn": "cudnn"}
    with cudnn_attn.backend("cudnn"):  # a thread started inside a block does not inherit it
        started_inside = []
        thread = threading.Thread(target=lambda: started_inside.append(chosen()))
        thread.start()
        thread.join()
    assert started_inside == ["auto"]


def test_reference_runs_every_door_on_the_cpu():
    q, k, v = qkv(seed=1)
    with cudnn_attn.backend("reference"):
        out = cudnn_attn.sdpa(q, k, v, is_causal=True)
        with cudnn_attn.Graph() as g:
            g.sdpa(q, k, v, use_causal_mask=True)
        graph_out = g(q, k, v)
        layer = cudnn_attn.nn.Attention(64, 2, causal=True, dtype=torch.bfloat16)
        y = layer(randn(1, 16, 64))
        pq, pk, pv, cu = packed()
        packed_out = cudnn_attn.varlen_sdpa(pq, pk, pv, cu, cu, 7, 7, causal=True)
    expected = float64_attention(q, k, v, causal=True)
    assert rel_err(out, expected) < 2e-2 and rel_err(graph_out, expected) < 2e-2
    assert y.shape == (1, 16, 64) and packed_out.shape == pq.shape


# Each door, first under "auto" (a reference plan is cached for the call), then the same call
# under "cudnn": on CPU tensors it must raise, so no cached reference run was taken.
def _sdpa():
    q, k, v = qkv(seed=2)
    return cudnn_attn.sdpa(q, k, v)


def _sdpa_training():
    q, k, v = (t.requires_grad_() for t in qkv(seed=2))
    return cudnn_attn.sdpa(q, k, v)


def _sdpa_softcap():
    q, k, v = qkv(seed=2)
    return cudnn_attn.sdpa(q, k, v, softcap=5.0)


def _varlen():
    q, k, v, cu = packed()
    return cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 7, 7)


def _graph():
    q, k, v = qkv(seed=2)
    with cudnn_attn.Graph() as g:
        g.sdpa(q, k, v)
    return g(q, k, v)


def _layer():
    torch.manual_seed(0)
    return cudnn_attn.nn.Attention(64, 2, dtype=torch.bfloat16)(randn(1, 16, 64))


def _fp8():
    q, k, v = qkv(seed=2)
    return cudnn_attn.sdpa_fp8(q, k, v)


DOORS = {
    "sdpa": _sdpa,
    "sdpa-training": _sdpa_training,
    "sdpa-softcap": _sdpa_softcap,
    "varlen_sdpa": _varlen,
    "Graph": _graph,
    "nn.Attention": _layer,
    "sdpa_fp8": _fp8,
}


@pytest.mark.parametrize("door", DOORS, ids=list(DOORS))
def test_a_cached_run_never_crosses_backends(door):
    call = DOORS[door]
    first = call()  # "auto": the reference backend (torch's kernel for plain sdpa calls), its runs cached
    with cudnn_attn.backend("cudnn"):
        with pytest.raises(UnsupportedError, match="device=cpu: cuDNN runs on CUDA tensors"):
            call()
    with cudnn_attn.backend("reference"):
        again = call()
    if door in ("sdpa", "sdpa-training", "nn.Attention"):  # "auto" runs these on torch's CPU kernel
        assert rel_err(again, first) < 2e-2
    else:
        assert torch.equal(again, first)  # the reference's runs, cached or not, give the same


def test_an_explicit_graph_backend_wins_over_the_block():
    q, k, v = qkv(seed=4)
    with cudnn_attn.backend("cudnn"):
        with cudnn_attn.Graph(backend="reference") as g:
            g.sdpa(q, k, v)
        out = g(q, k, v)
    assert rel_err(out, float64_attention(q, k, v)) < 2e-2


def test_under_cudnn_a_call_for_torchs_kernel_says_why():
    q, k, v = (t.double() for t in qkv(seed=5))
    expected = cudnn_attn.sdpa(q, k, v)  # "auto": float64 runs on torch's kernel
    assert rel_err(expected, float64_attention(q, k, v)) < 1e-10
    with cudnn_attn.backend("cudnn"):
        with pytest.raises(UnsupportedError, match="float64: cuDNN attention has no double-precision path"):
            cudnn_attn.sdpa(q, k, v)


# On a GPU the choice changes where CUDA tensors run: "reference" keeps them off cuDNN.


def _held_backends():
    return {run.backend for run in prepared.held()}


@pytest.mark.gpu
def test_gpu_reference_block_runs_cuda_tensors_on_the_reference():
    q, k, v = qkv(seed=6, shape=(2, 4, 128, 64), device="cuda")
    prepared.clear()
    with cudnn_attn.backend("reference"):
        ref = cudnn_attn.sdpa(q, k, v, is_causal=True)
    assert _held_backends() == {"reference"}
    on_cudnn = cudnn_attn.sdpa(q, k, v, is_causal=True)
    assert "cudnn" in _held_backends()
    expected = float64_attention(q.cpu(), k.cpu(), v.cpu(), causal=True)
    assert rel_err(ref, expected) < 2e-2 and rel_err(on_cudnn, expected) < 2e-2


@pytest.mark.gpu
def test_gpu_reference_block_trains_off_cudnn():
    q, k, v = (t.requires_grad_() for t in qkv(seed=7, shape=(2, 4, 128, 64), device="cuda"))
    prepared.clear()
    with cudnn_attn.backend("reference"):
        cudnn_attn.sdpa(q, k, v, is_causal=True).float().sum().backward()
    assert _held_backends() == {"reference"}  # neither cuDNN graphs nor torch's cuDNN op


@pytest.mark.gpu
def test_gpu_varlen_and_graph_follow_the_block():
    q, k, v, cu = packed(device="cuda")
    prepared.clear()
    with cudnn_attn.backend("reference"):
        ref = cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 7, 7, causal=True)
        with cudnn_attn.Graph() as g:
            g.sdpa(*qkv(seed=8, shape=(1, 2, 64, 64), device="cuda"))
    assert _held_backends() == {"reference"} and g.nodes[0].backend == "reference"
    on_cudnn = cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 7, 7, causal=True)
    assert rel_err(ref, on_cudnn) < 2e-2


@pytest.mark.gpu
def test_gpu_cudnn_block_refuses_what_would_leave_for_torch():
    q, k, v = (t.float() for t in qkv(seed=9, shape=(1, 2, 64, 64), device="cuda"))
    with cudnn_attn.backend("cudnn"):
        out = cudnn_attn.sdpa(q, k, v)  # float32 forward: cuDNN runs it when asked
        with pytest.raises(UnsupportedError, match="no double-precision path"):
            cudnn_attn.sdpa(q.double(), k.double(), v.double())
    assert rel_err(out, float64_attention(q.cpu(), k.cpu(), v.cpu())) < 1e-3


def test_a_backward_on_another_thread_runs_in_the_forwards_block():
    """The autograd engine runs CUDA backwards on a thread of its own, which starts outside the
    caller's block: the library's autograd functions carry the forward's choice to it."""
    seen = []

    @backend_choice.kept_for_backward
    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(backend_choice.chosen())
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    with cudnn_attn.backend("reference"):
        y = Spy.apply(x).sum()
    worker = threading.Thread(target=y.backward)  # a fresh thread: outside any block
    worker.start()
    worker.join()
    assert seen == ["reference"] and torch.equal(x.grad, torch.full((3,), 2.0))
    assert backend_choice.chosen() == "auto"


def test_the_reference_is_exact_in_the_first_call_of_fresh_processes():
    """torch 2.13's first parallel CPU exp after a matmul came out of one worker off by up to 1e-4
    in about one process in eight: the reference's float32 results were then 2.5e-5 off float64
    (notebooks failed their checks now and then). It warms exp once per dtype."""
    script = (
        "import torch, cudnn_attn\n"
        "torch.manual_seed(0)\n"
        "cu = torch.tensor([0, 40, 100, 128], dtype=torch.int32)\n"
        "q, k, v = (torch.randn(128, h, 16) for h in (4, 2, 2))\n"
        "out = cudnn_attn.varlen_sdpa(q, k, v, cu, cu, 60, 60, causal=True, enable_gqa=True)\n"
        "ref = cudnn_attn.varlen_sdpa(*(t.double() for t in (q, k, v)), cu, cu, 60, 60, causal=True, enable_gqa=True)\n"
        "print(float((out.double() - ref).norm() / ref.norm()))\n"
    )
    runs = [subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) for _ in range(8)]
    errors = [float(run.communicate(timeout=300)[0]) for run in runs]
    assert max(errors) < 1e-6, errors
