"""A server's plans ahead of time: ``PagedAttention.warm``, serving shapes for ``cudnn-attn cache
warm``, and (on a GPU) a restarted server that serves its first steps from the plan store."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cudnn_attn
from cudnn_attn.bench import serving_shapes
from cudnn_attn.cli import commands as cli
from cudnn_attn.errors import ValidationError
from cudnn_attn.runtime import prepared

HQ, HKV, D, PAGE = 8, 2, 32, 16
SERVER = "paged,h=8,hkv=2,d=64,page=16,batch=4,pages=8,cache=40,sq=1/4,prefill=64"


def test_a_serving_shape_reads_every_key():
    shape = serving_shapes.parse(SERVER + ",graph,layout=NPHD,dtype=fp16")
    assert (shape.h, shape.hkv, shape.d, shape.page, shape.batch, shape.pages, shape.num_pages) == (
        8,
        2,
        64,
        16,
        4,
        8,
        40,
    )
    assert shape.sq == (1, 4) and shape.prefill == (64,) and shape.graph and shape.layout == "NPHD"
    assert serving_shapes.parse("paged,batch=2,pages=3").num_pages == 6  # no cache size: every sequence's pages
    assert serving_shapes.is_serving(" paged ,h=1") and not serving_shapes.is_serving("b=1,h=2")


@pytest.mark.parametrize(
    "text,message",
    [
        ("paged,frogs=2", "frogs: unknown serving-shape key"),
        ("paged,sq=1/x", "sq: '1/x' is not a number"),
        ("paged,dtype=fp32", "dtype: 'fp32'"),
        ("paged,layout=BHSD", "layout: 'BHSD'"),
        ("paged,page=0", "page: 0"),
        # passed parse before, and failed only once a GPU built the step (or not at all)
        ("paged,sq=17", "sq: 17; decode takes 1..16"),
        ("paged,sq=0", "sq: 0; decode takes 1..16"),
        ("paged,sq=", "sq: none; decode takes"),
        ("paged,h=32,hkv=3", "hkv: 3 does not divide h=32"),
        ("paged,prefill=-1", "prefill: -1; token counts must be >= 1"),
        ("paged,graph=maybe", "graph: 'maybe'; a flag is bare"),
    ],
)
def test_bad_serving_shapes_are_refused_naming_the_key(text, message):
    with pytest.raises(ValidationError, match=message):
        serving_shapes.parse(text)


def test_a_serving_shapes_label_names_a_layout_other_than_nhpd():
    assert serving_shapes.parse("paged").label() != serving_shapes.parse("paged,layout=NPHD").label()
    assert "NPHD" in serving_shapes.parse("paged,layout=NPHD").label()
    assert serving_shapes.parse("paged,graph=0").graph is False and serving_shapes.parse("paged,graph").graph


def test_the_command_needs_a_gpu_and_checks_serving_shapes_first(capsys):
    if torch.cuda.is_available():
        pytest.skip("this checks the message shown without a GPU")
    assert cli.main(["cache", "warm", "paged,h=8,frogs=1"]) == 2
    assert "frogs: unknown serving-shape key" in capsys.readouterr().err
    assert cli.main(["cache", "warm", SERVER]) == 1  # no GPU: an environment error
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _step(batch, q_lens=None, s_q=1, seed=0):
    gen = torch.Generator().manual_seed(seed)
    table = torch.randperm(40, generator=gen)[: batch * 8].view(batch, 8).int()
    lengths = torch.randint(20, 129, (batch,), generator=gen, dtype=torch.int32)
    k, v = (torch.randn(40, HKV, PAGE, D, generator=gen).bfloat16() for _ in range(2))
    if q_lens is None:
        return table, lengths, None, torch.randn(batch, HQ, s_q, D, generator=gen).bfloat16(), k, v
    q_lens = torch.tensor(q_lens, dtype=torch.int32)
    return table, lengths, q_lens, torch.randn(64, HQ, D, generator=gen).bfloat16(), k, v


@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda_graph"])
def test_after_warm_the_servers_steps_build_nothing(cuda_graph):
    """Decode with 1 and 4 query tokens and prefill steps of 64 tokens (chunks of any length) at
    the warmed geometry find every plan built and every run prepared."""
    attn = cudnn_attn.PagedAttention(
        HQ, HKV, D, PAGE, dtype=torch.bfloat16, max_batch=4, max_pages_per_seq=8, cuda_graph=cuda_graph
    )
    cudnn_attn.default_cache().clear()  # no eviction from earlier plans while this test counts
    prepared.clear()  # so that warm prepares each of its runs here
    sources = attn.warm(40, s_q=(1, 4), prefill_tokens=(64,))
    warmed = prepared.held()
    assert len(sources) == len(warmed) > 0
    misses = cudnn_attn.default_cache().stats()["misses"]
    steps = [
        _step(4, s_q=1),
        _step(4, s_q=4, seed=1),
        _step(4, q_lens=[20, 3, 1, 17], seed=2),
        _step(4, q_lens=[9, 0, 1, 2], seed=3),
        _step(4, q_lens=[15, 15, 15, 15], seed=4),
    ]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # where warm() warmed
    for table, lengths, q_lens, q, k, v in steps:
        attn.plan(table.to(device), lengths.to(device), q_lens=q_lens)
        assert torch.isfinite(attn.run(q.to(device), k.to(device), v.to(device))).all()
    assert cudnn_attn.default_cache().stats()["misses"] == misses  # no plan built
    assert all(any(run is old for old in warmed) for run in prepared.held())  # no run prepared


def test_warm_needs_the_step_geometry():
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16)
    with pytest.raises(ValidationError, match="max_batch: warm\\(\\) needs max_batch"):
        attn.warm(40)
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, max_batch=2, max_pages_per_seq=2)
    with pytest.raises(ValidationError, match="s_q: \\(1, 17\\); decode takes 1..16"):
        attn.warm(40, s_q=(1, 17))
    for counts in (dict(s_q=4), dict(prefill_tokens=64), dict(s_q=None), dict(s_q="14")):
        name, given = next(iter(counts.items()))  # not torch's "'int' object is not iterable"
        with pytest.raises(ValidationError, match=f"{name}: {given!r}; expected a tuple of ints"):
            attn.warm(40, **counts)


def test_warm_reads_counts_given_as_any_iterable_once():
    """A generator of counts was read by the checks and left empty for the steps: nothing warmed."""
    attn = cudnn_attn.PagedAttention(HQ, HKV, D, PAGE, dtype=torch.bfloat16, max_batch=2, max_pages_per_seq=2)
    assert len(attn.warm(40, s_q=(n for n in (1, 2)), prefill_tokens=[8])) == len(
        attn.warm(40, s_q=(1, 2), prefill_tokens=(8,))
    )


SERVE = """
import torch, cudnn_attn
from cudnn_attn.bench import serving_shapes
from cudnn_attn.runtime import prepared
shape = serving_shapes.parse({server!r})
attn = shape.attention("cuda")  # as the server makes it: no autotune
gen = torch.Generator().manual_seed(0)
k, v = (torch.randn(40, 2, 16, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2))
table = torch.randperm(40, generator=gen)[:32].view(4, 8).int().cuda()
lengths = torch.tensor([100, 7, 128, 60], dtype=torch.int32).cuda()
worst = 0.0
for q, q_lens in ((torch.randn(4, 8, 1, 64), None), (torch.randn(4, 8, 4, 64), None),
                  (torch.randn(64, 8, 64), torch.tensor([30, 7, 1, 20], dtype=torch.int32))):
    attn.plan(table, lengths, q_lens=q_lens)
    got = attn.run(q.to("cuda", torch.bfloat16), k, v).float().cpu()
    ref = shape.attention("cpu")
    ref.plan(table.cpu(), lengths.cpu(), q_lens=q_lens)
    want = ref.run(q.bfloat16(), k.cpu(), v.cpu()).float()
    worst = max(worst, float((got - want).norm() / want.norm()))
print(" ".join(run.plan.source for run in prepared.held() if run.problem.device != "cpu"), worst)
"""


@pytest.mark.gpu
@pytest.mark.parametrize("graph", ["", ",graph"], ids=["eager", "cuda_graph"])
def test_a_server_started_on_a_warm_store_builds_no_plan(tmp_path, graph):
    env = {**os.environ, "CUDNN_ATTN_CACHE_DIR": str(tmp_path)}
    warm = subprocess.run(
        [sys.executable, "-m", "cudnn_attn.cli", "cache", "warm", SERVER + graph],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert warm.returncode == 0, warm.stderr
    assert "built" in warm.stdout and list(tmp_path.glob("*.plan"))
    served = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SERVE.format(server=SERVER + graph))],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert served.returncode == 0, served.stderr
    *sources, worst = served.stdout.split()
    assert sources and set(sources) == {"disk"}, sources
    assert float(worst) < 1.5e-2
