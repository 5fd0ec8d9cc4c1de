"""Autotuning, the persistent plan store and shape buckets on a real GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import rel_err

import cudnn_attn

pytestmark = pytest.mark.gpu


def qkv(s=1024, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 8, s, 128, generator=gen).to("cuda", torch.bfloat16) for _ in range(3)]


def torch_ref(q, k, v, **kw):
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


def test_autotune_times_every_candidate_and_keeps_the_fastest():
    q, k, v = qkv()
    with cudnn_attn.Graph(autotune=True, cache=cudnn_attn.PlanCache()) as g:
        g.sdpa(q, k, v, use_causal_mask=True)
    choice = g.nodes[0].plan.choice
    assert choice.tuned and choice.timings_ms and choice.name in choice.timings_ms
    # The fastest, or the heuristic's pick when no challenger beats it clearly (timings are noisy).
    assert choice.timings_ms[choice.name] <= 1.1 * min(choice.timings_ms.values())
    assert rel_err(g(q, k, v), torch_ref(q, k, v, is_causal=True)) < 1.6e-2


def test_store_round_trip_skips_building(tmp_path):
    q, k, v = qkv(seed=1)
    with cudnn_attn.Graph(autotune=True, cache=cudnn_attn.PlanCache(path=tmp_path)) as g:
        g.sdpa(q, k, v, use_causal_mask=True)
    assert g.nodes[0].plan.source == "built" and len(list(tmp_path.glob("*.plan"))) == 1
    with cudnn_attn.Graph(autotune=True, cache=cudnn_attn.PlanCache(path=tmp_path)) as again:  # a new in-memory cache
        again.sdpa(q, k, v, use_causal_mask=True)
    plan = again.nodes[0].plan
    assert plan.source == "disk" and plan.choice.name == g.nodes[0].plan.choice.name
    out = torch.full_like(q, float("nan"))
    again(q, k, v, out=out)
    assert rel_err(out, torch_ref(q, k, v, is_causal=True)) < 1.6e-2


def test_a_damaged_stored_plan_is_rebuilt_and_rewritten(tmp_path):
    q, k, v = qkv(s=512, seed=2)
    with cudnn_attn.Graph(cache=cudnn_attn.PlanCache(path=tmp_path)) as g:
        g.sdpa(q, k, v)
    (file,) = tmp_path.glob("*.plan")
    file.write_bytes(file.read_bytes()[:-100])
    with cudnn_attn.Graph(cache=cudnn_attn.PlanCache(path=tmp_path)) as again:
        again.sdpa(q, k, v)
    assert again.nodes[0].plan.source == "built"
    assert rel_err(again(q, k, v), torch_ref(q, k, v)) < 1.6e-2
    with cudnn_attn.Graph(cache=cudnn_attn.PlanCache(path=tmp_path)) as third:
        third.sdpa(q, k, v)
    assert third.nodes[0].plan.source == "disk"


def test_a_fresh_process_loads_the_stored_plan(tmp_path):
    script = textwrap.dedent(
        """
        import torch, cudnn_attn
        gen = torch.Generator().manual_seed(3)
        q = torch.randn(2, 8, 1024, 128, generator=gen).to("cuda", torch.bfloat16)
        with cudnn_attn.Graph(autotune=True) as g:
            g.sdpa(q, q, q, use_causal_mask=True)
        out = g(q).float()
        ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
        print(g.nodes[0].plan.source, float((out - ref).norm() / ref.norm()))
        """
    )
    env = {**os.environ, "CUDNN_ATTN_CACHE_DIR": str(tmp_path)}
    runs = [
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        ).stdout.split()
        for _ in range(2)
    ]
    assert runs[0][0] == "built" and runs[1][0] == "disk"
    assert float(runs[0][1]) < 1.6e-2 and float(runs[1][1]) < 1.6e-2


def test_buckets_bound_the_plans_on_cudnn():
    cache = cudnn_attn.PlanCache()
    attend = cudnn_attn.BucketedAttention(buckets=(256, 512, 1024), causal="bottom_right", cache=cache)
    for s in (100, 200, 256, 300, 511, 700, 1000):
        q, k, v = qkv(s=s, seed=s)
        mask = torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
        assert rel_err(attend(q, k, v), torch_ref(q, k, v, attn_mask=mask)) < 1.6e-2, s
    assert attend.plan_count == 3 and cache.stats()["builds"] == 3


def test_cache_warm_command_stores_plans_a_second_warm_loads(tmp_path, monkeypatch, capsys):
    import cudnn_attn.cache as cache_module
    from cudnn_attn.cli import commands as cli

    monkeypatch.setattr(cache_module, "_default", cudnn_attn.PlanCache(path=tmp_path))
    shape = "b=1,h=8,hkv=2,s=512,d=64,causal,bwd"
    assert cli.main(["cache", "warm", shape, "--no-autotune"]) == 0
    assert "(built)" in capsys.readouterr().out
    assert len(list(tmp_path.glob("*.plan"))) == 2  # forward and backward
    monkeypatch.setattr(cache_module, "_default", cudnn_attn.PlanCache(path=tmp_path))  # as a restarted server
    assert cli.main(["cache", "warm", shape, "--no-autotune"]) == 0
    assert "(disk)" in capsys.readouterr().out
    assert cli.main(["cache", "ls"]) == 0
    listing = capsys.readouterr().out
    assert "2 plan(s)" in listing and "DAMAGED" not in listing
