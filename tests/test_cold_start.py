"""Cold start: handles made without the frontend's device probe, one handle per thread
(no frontend default handle beside it), and stored plans that load exactly as usable as
built ones."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from conftest import rel_err

import cudnn_attn
from cudnn_attn.ops.cudnn import frontend_internals


def run_fresh(script: str, **env: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.split()


def fake_frontend(wrap_fails: bool):
    destroyed, made = [], []

    class Handle:
        def __init__(self, raw, ordinal, stream):
            if wrap_fails:
                raise TypeError("another Handle")
            self.raw, self.ordinal, self.stream = raw, ordinal, stream

    native = types.SimpleNamespace(
        create_handle=lambda: made.append(len(made) + 100) or made[-1],
        get_stream=lambda raw: 0,
        _raw_destroy_handle=destroyed.append,
    )
    module = types.SimpleNamespace(_pybind_module=native, Handle=Handle, create_handle=lambda: "public")
    return module, destroyed, made


def test_new_handle_wraps_the_backend_handle_with_its_device(monkeypatch):
    module, destroyed, made = fake_frontend(wrap_fails=False)
    monkeypatch.setitem(sys.modules, "cudnn", module)
    handle = frontend_internals.new_handle(3)
    assert (handle.raw, handle.ordinal, handle.stream) == (100, 3, 0)
    assert made == [100] and destroyed == []


def test_new_handle_falls_back_to_the_public_call_and_releases_what_it_made(monkeypatch):
    module, destroyed, made = fake_frontend(wrap_fails=True)
    monkeypatch.setitem(sys.modules, "cudnn", module)
    assert frontend_internals.new_handle(0) == "public"
    assert made == [100] and destroyed == [100]


def test_new_handle_asks_publicly_where_the_internals_differ(monkeypatch):
    module, destroyed, made = fake_frontend(wrap_fails=False)
    del module._pybind_module.get_stream
    monkeypatch.setitem(sys.modules, "cudnn", module)
    assert frontend_internals.new_handle(0) == "public"
    assert made == [] and destroyed == []


# ---- on a GPU -----------------------------------------------------------------------------------

COLD = """
import torch
torch.cuda.init(); torch.empty(1, device="cuda")
import cudnn, cudnn_attn
gen = torch.Generator().manual_seed(5)
q = torch.randn(2, 4, 512, 64, generator=gen).to("cuda", torch.bfloat16)
with cudnn_attn.Graph() as g:
    g.sdpa(q, q, q, use_causal_mask=True)
out = g(q).float()
ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
plan = g.nodes[0].plan
probe = getattr(getattr(cudnn, "_device", None), "_driver", None)
defaults = getattr(getattr(cudnn, "_pygraph", None), "_DEFAULT_HANDLE_REGISTRY", [])
print(plan.source, plan.workspace_size, plan.choice.name.replace(" ", "_"), float((out - ref).norm() / ref.norm()))
print(probe is None or probe.cache_info().currsize == 0, len(defaults))
"""


@pytest.mark.gpu
def test_a_cold_process_loads_its_plan_with_one_handle_and_no_device_probe(tmp_path):
    built = run_fresh(COLD, CUDNN_ATTN_CACHE_DIR=str(tmp_path))
    loaded = run_fresh(COLD, CUDNN_ATTN_CACHE_DIR=str(tmp_path))
    assert built[0] == "built" and loaded[0] == "disk"
    assert loaded[1:3] == built[1:3]  # the same workspace size and plan
    assert float(built[3]) < 1.6e-2 and float(loaded[3]) < 1.6e-2
    # Loading made the library's handle only: no frontend default handle, no driver probe
    # (the probe imports the CUDA driver's Python bindings: about 20 ms of a cold start).
    assert loaded[4:] == ["True", "0"]


@pytest.mark.gpu
def test_a_stored_plan_is_as_usable_as_a_built_one(tmp_path):
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 8, 384, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    with cudnn_attn.Graph(cache=cudnn_attn.PlanCache(path=tmp_path)) as g:
        g.sdpa(q, k, v, use_causal_mask=True)
    with cudnn_attn.Graph(cache=cudnn_attn.PlanCache(path=tmp_path)) as again:
        again.sdpa(q, k, v, use_causal_mask=True)
    built, loaded = g.nodes[0].plan, again.nodes[0].plan
    assert (built.source, loaded.source) == ("built", "disk")
    assert loaded.workspace_size == built.workspace_size
    assert loaded.choice.name == built.choice.name
    assert loaded.direct_uids(("q", "k", "v"), ("o",)) == built.direct_uids(("q", "k", "v"), ("o",))
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    ours, theirs = g(q, k, v), again(q, k, v)
    assert torch.equal(ours, theirs)  # the same engine on the same inputs
    assert rel_err(theirs, expected) < 1.6e-2
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on_stream = again(q, k, v)
    stream.synchronize()
    assert torch.equal(on_stream, ours)
