"""``ops/dispatch.select_decode``: a paged decode step's kernel through the one dispatch (a
priority list per device, every refusal listed, a debug line per kernel passed over), from the
kernels' facts handed in as data, and ``PagedAttention(decode_kernel=)`` on top of it."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

import cudnn_attn
from cudnn_attn.errors import UnsupportedError, ValidationError
from cudnn_attn.ops import dispatch
from cudnn_attn.ops.decode_step import EAGER_MLA_CUDNN_BYTES, DecodeStep
from cudnn_attn.serving import step as serving_step

TILE = 64


def decode(
    batch=4,
    heads=32,
    kv_heads=8,
    s_q=1,
    *,
    device="cuda:0",
    captured=True,
    fp8=False,
    runs=True,
    hopper=False,
    dims=(128, 128),
    page=64,
    pages=512,
):
    return DecodeStep(device, batch, heads, kv_heads, s_q, page, *dims, captured, fp8, runs, hopper, TILE, pages)


def choice_before_the_dispatch(step: DecodeStep, requested: str) -> str:
    """The choice as ``serving/schedule.choose`` and ``step._derive`` made it before it joined the
    dispatch, transcribed: the oracle the dispatch must agree with."""
    if requested == "triton" and not step.triton_runs:
        return "refused"
    mla = step.num_kv_heads == 1 and step.head_dim_v != step.head_dim
    triton = step.triton_runs and (step.captured or mla or step.fp8)
    kernel = None if requested == "auto" else requested
    if mla:
        if step.s_q > 1:
            return "cudnn"
        small_eager = not step.captured and step.cudnn_bytes <= EAGER_MLA_CUDNN_BYTES
        if kernel is None:
            return (
                "triton"
                if triton and not small_eager and (step.batch > 1 or step.num_q_heads >= 64 or step.hopper)
                else "cudnn"
            )
        return kernel
    packs = step.num_q_heads // step.num_kv_heads * step.s_q <= TILE
    if kernel is None:
        return "triton" if triton and packs else "cudnn"
    return "cudnn" if kernel == "triton" and not packs else kernel


def test_the_dispatch_chooses_as_serving_did():
    checked = 0
    for batch, (heads, kv_heads, dims), s_q, captured, fp8, where, hopper, requested in itertools.product(
        (1, 4),
        (
            (32, 8, (128, 128)),
            (64, 2, (128, 128)),
            (8, 8, (64, 64)),
            (16, 1, (128, 128)),
            (16, 1, (576, 512)),
            (128, 1, (576, 512)),
        ),
        (1, 2, 4, 16),
        (False, True),
        (False, True),
        (("cuda:0", True), ("cuda:0", False), ("cpu", False)),
        (False, True),
        ("auto", "cudnn", "triton"),
    ):
        device, runs = where
        step = decode(
            batch,
            heads,
            kv_heads,
            s_q,
            device=device,
            captured=captured,
            fp8=fp8,
            runs=runs,
            hopper=hopper and runs,
            dims=dims,
        )
        want = choice_before_the_dispatch(step, requested)
        try:
            got = dispatch.select_decode(step, requested).name
        except UnsupportedError:
            got = "refused"
        assert got == want, (step, requested)
        checked += 1
    assert checked == 2 * 6 * 4 * 2 * 2 * 3 * 2 * 3


def test_ours_is_first_on_a_gpu_and_the_list_order_decides(monkeypatch):
    step = decode()
    assert dispatch.DECODE_PRIORITY["auto"]["cuda"] == ("triton", "cudnn")
    chosen = dispatch.select_decode(step)
    assert (chosen.name, chosen.one_kernel) == ("triton", True)
    monkeypatch.setitem(dispatch.DECODE_PRIORITY, "auto", {"cuda": ("cudnn", "triton"), "cpu": ("cudnn",)})
    chosen = dispatch.select_decode(step)
    assert chosen is dispatch.PAGED_CALLS and not chosen.one_kernel


def test_the_cpu_list_runs_cudnns_paged_calls():
    # On the CPU those calls go through runtime.prepare to the reference backend.
    assert dispatch.select_decode(decode(device="cpu", runs=False)) is dispatch.PAGED_CALLS


def test_when_no_kernel_runs_a_step_one_error_lists_every_reason(monkeypatch):
    monkeypatch.setitem(dispatch.DECODE_PRIORITY, "auto", {"cuda": ("triton",), "cpu": ("triton",)})
    step = decode(heads=64, kv_heads=2, s_q=4, captured=False, runs=False, page=512)
    with pytest.raises(UnsupportedError) as caught:
        dispatch.select_decode(step)
    lines = caught.value.problems
    assert len(lines) == 3, lines
    assert lines[0].startswith("'triton' needs a CUDA device") and "page 512" in lines[0]
    assert lines[1] == "32 query heads per K/V head by 4 tokens exceed its tile of 64 rows"
    assert lines[2].startswith("an eager step over 16-bit caches")
    assert "triton decode kernel" in str(caught.value)


def test_a_kernel_passed_over_is_logged_once_at_debug(caplog):
    step = decode(batch=3, captured=False)  # eager, 16-bit caches: cuDNN's calls
    with caplog.at_level(logging.DEBUG, logger="cudnn_attn"):
        assert dispatch.select_decode(step).name == "cudnn"
        dispatch.select_decode(step)
    said = [r.getMessage() for r in caplog.records if "passed over" in r.getMessage()]
    assert len(said) == 1, said
    assert step.describe() in said[0] and "triton backend passed over: an eager step" in said[0]


def test_mla_reasons_name_the_query_tokens_and_the_small_single_sequence(caplog):
    with caplog.at_level(logging.DEBUG, logger="cudnn_attn"):
        assert dispatch.select_decode(decode(1, 16, 1, 1, dims=(576, 512))).name == "cudnn"
        assert dispatch.select_decode(decode(4, 16, 1, 2, dims=(576, 512))).name == "cudnn"
    said = " | ".join(r.getMessage() for r in caplog.records)
    assert "one sequence of 16 heads (under 64) and no Hopper kernel" in said
    assert "MLA's kernels take one query token (2 here)" in said


def test_an_eager_mla_step_small_enough_for_the_host_to_bound_it_takes_cudnns_call(caplog):
    """Eager, our MLA kernels' launches cost the host more than cuDNN's reads cost the GPU at one
    sequence over 2k tokens (71 MiB); at 32k (1.1 GiB) or captured, our kernel."""
    small = decode(1, 16, 1, 1, dims=(576, 512), captured=False, hopper=True, pages=32)
    with caplog.at_level(logging.DEBUG, logger="cudnn_attn"):
        assert dispatch.select_decode(small).name == "cudnn"
    assert "an eager MLA step whose reads on cuDNN's paged call (68 MiB)" in caplog.text
    for step in (
        decode(1, 16, 1, 1, dims=(576, 512), captured=False, hopper=True, pages=512),
        decode(1, 16, 1, 1, dims=(576, 512), captured=True, hopper=True, pages=32),
        decode(64, 128, 1, 1, dims=(576, 512), captured=False, hopper=True, pages=64),
    ):
        assert dispatch.select_decode(step).name == "triton", step
    assert dispatch.select_decode(small, "triton").name == "triton"  # asked for by name: it runs


def test_asked_for_by_name_the_kernel_must_run_here():
    with pytest.raises(UnsupportedError) as caught:
        dispatch.select_decode(decode(device="cpu", runs=False, page=16, dims=(32, 32)), "triton")
    error = caught.value
    assert error.problems == [
        "decode_kernel: 'triton' needs a CUDA device, Triton, a power-of-two page of 16-256 tokens and one "
        "head dim for K and V, or MLA's latent (one K/V head, powers of two for V and the rope part) "
        "(here cpu, page 16, head dims 32/32)"
    ]
    assert error.alternatives == ["decode_kernel=None or 'cudnn'"]
    assert str(error).startswith("PagedAttention")


def test_asked_for_by_name_the_measured_preferences_are_ignored_but_the_tile_is_not(caplog):
    eager = decode(captured=False)
    assert dispatch.select_decode(eager).name == "cudnn"
    assert dispatch.select_decode(eager, "triton").name == "triton"
    assert dispatch.select_decode(decode(), "cudnn").name == "cudnn"
    with caplog.at_level(logging.DEBUG, logger="cudnn_attn"):
        assert dispatch.select_decode(decode(heads=64, kv_heads=2, s_q=4), "triton").name == "cudnn"
    assert any("exceed its tile of 64 rows" in r.getMessage() for r in caplog.records)


def test_paged_attention_chooses_once_per_step_geometry(monkeypatch):
    asked = []

    def counted(step, requested="auto"):
        asked.append((step.batch, step.s_q, requested))
        return dispatch.select_decode(step, requested)

    monkeypatch.setattr(serving_step, "select_decode", counted)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(12, 2, 16, 32, generator=gen).bfloat16() for _ in range(2)]
    table, lengths = torch.arange(8, dtype=torch.int32).view(2, 4), torch.tensor([37, 64], dtype=torch.int32)
    attn = cudnn_attn.PagedAttention(8, 2, 32, 16, dtype=torch.bfloat16)
    for s_q in (1, 1, 4, 1, 4):
        attn.plan(table, lengths)  # derives every geometry run before again
        attn.run(torch.randn(2, 8, s_q, 32, generator=gen).bfloat16(), *caches)
    assert asked == [(2, 1, "auto"), (2, 4, "auto")]
    assert attn.schedule is not None and attn.schedule.kernel == "cudnn"


def test_decode_kernel_values_and_the_forced_error_through_paged_attention():
    with pytest.raises(ValidationError, match=r"decode_kernel: 'fast'; allowed None, 'cudnn' or 'triton'"):
        cudnn_attn.PagedAttention(8, 2, 32, 16, dtype=torch.bfloat16, decode_kernel="fast")
    attn = cudnn_attn.PagedAttention(8, 2, 32, 16, dtype=torch.bfloat16, decode_kernel="triton")
    attn.plan(torch.arange(8, dtype=torch.int32).view(2, 4), torch.tensor([37, 64], dtype=torch.int32))
    cache = torch.zeros(12, 2, 16, 32, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedError, match=r"decode_kernel: 'triton' needs a CUDA device") as caught:
        attn.run(torch.zeros(2, 8, 1, 32, dtype=torch.bfloat16), cache, cache)
    assert caught.value.alternatives == ["decode_kernel=None or 'cudnn'"]
