"""The target benchmarks' CPU-checkable parts: the decoder stack, the naive attention, the paged
inputs and dense check, the formatters, and the command line that reaches them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import rel_err

import cudnn_attn
from cudnn_attn.bench import attention, targets
from cudnn_attn.bench.targets import DecoderStack, PagedDecodeShape, naive_attention, torch_sdpa
from cudnn_attn.cli import commands as cli
from cudnn_attn.cli import versions

TINY = {"hidden": 64, "heads": 4, "layers": 4}


def _stack_and_input(dtype: torch.dtype) -> tuple[DecoderStack, torch.Tensor]:
    torch.manual_seed(0)
    model = DecoderStack(TINY["hidden"], TINY["heads"], TINY["layers"], dtype=dtype)
    x = torch.randn(2, 16, TINY["hidden"], dtype=dtype, requires_grad=True)
    return model, x


def test_twin_stack_shares_every_parameter():
    model, _ = _stack_and_input(torch.float32)
    twin = model.with_attention(cudnn_attn.sdpa)
    assert twin.attend is cudnn_attn.sdpa and model.attend is torch_sdpa
    assert [id(p) for p in twin.parameters()] == [id(p) for p in model.parameters()]


def test_stack_in_float32_is_the_same_through_any_equal_attention():
    # float32 (cudnn_attn.sdpa takes fp16/bf16 only): the stack's plumbing, forward and backward,
    # depends on nothing but the attention's values.
    model, x = _stack_and_input(torch.float32)
    expected = targets.training_step(model, x)
    actual = targets.training_step(model.with_attention(naive_attention), x)
    assert len(actual) == 2 + len(list(model.parameters()))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


def test_stack_with_cudnn_attn_sdpa_matches_torch_sdpa_in_bf16():
    # On CPU cudnn_attn.sdpa runs on the reference backend; both attentions round to bf16.
    model, x = _stack_and_input(torch.bfloat16)
    expected = targets.training_step(model, x)
    actual = targets.training_step(model.with_attention(cudnn_attn.sdpa), x)
    for a, e in zip(actual, expected):
        assert rel_err(a, e) < 2e-2


@pytest.mark.parametrize("is_causal", [False, True])
def test_naive_attention_matches_torch_sdpa(is_causal):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 24, 16, generator=gen) for _ in range(3))
    expected = torch_sdpa(q, k, v, is_causal=is_causal)
    torch.testing.assert_close(naive_attention(q, k, v, is_causal=is_causal), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(naive_attention(q, k, v, scale=0.3), torch_sdpa(q, k, v, scale=0.3))


def test_paged_graph_matches_the_dense_gather():
    shape = PagedDecodeShape(batch=3, heads=4, kv_heads=2, head_dim=16, seq_kv=64, page_size=16)
    t = targets.paged_decode_inputs(shape, device="cpu")
    assert t["k_cache"].shape == (12, 16, 2, 16) and t["page_table"].shape == (3, 4)
    assert sorted(t["page_table"].flatten().tolist()) == list(range(12))  # every page used once
    out = targets.paged_graph(t)(*targets._paged_args(t))
    assert rel_err(out, targets.dense_paged_attention(t)) < 2e-2


def test_paged_bytes_count_the_pages_read_plus_q_and_o():
    t = targets.paged_decode_inputs(PagedDecodeShape(batch=2, seq_kv=128), device="cpu")
    kv = 2 * (2 * 128) * 8 * 128 * 2  # K and V, tokens of both sequences, Hkv, d, bf16
    q = 2 * 32 * 128 * 2
    assert targets.paged_bytes(t) == {"kv": kv, "decode": kv + 2 * q, "copy": 2 * kv}


def _timing(median: float) -> dict[str, float]:
    return {"median_us": median, "low_us": 0.9 * median, "high_us": 1.1 * median}


def test_format_stack():
    shape = {
        "timings": {"torch sdpa": _timing(12000.0), "cudnn_attn.sdpa": _timing(11000.0)},
        "ratio_ours_over_torch": 11 / 12,
        "rel_err": {"out": 1e-3, "grad_x": 2e-3, "grad_params_max": 3e-3},
    }
    config = {"layers": 4, "hidden": 2048, "heads": 16, "causal": True, "dtype": "bf16"}
    text = targets.format_stack({"config": config, "shapes": {"B2 S512": shape}})
    assert "B2 S512: ours/torch 0.917" in text
    assert any(line.split()[:3] == ["torch", "sdpa", "12.00"] for line in text.splitlines())


def test_format_paged_decode_reports_each_column_against_frontend_direct():
    moved = {"kv": 1000, "decode": 1100, "copy": 2000}
    timings = {
        "g(q, k, v, table, lengths)": _timing(2.2),
        "frontend direct": _timing(2.0),
        "copy of the K+V bytes": _timing(2.0),
    }
    columns = targets._bandwidth_columns(timings, moved, {"frontend direct": 1e-3})
    assert columns["frontend direct"]["pct_of_frontend"] == pytest.approx(100.0)
    assert columns["g(q, k, v, table, lengths)"]["pct_of_frontend"] == pytest.approx(100 * 2.0 / 2.2)
    assert columns["copy of the K+V bytes"]["gbps"] == pytest.approx(1.0)  # 2000 bytes in 2 us
    config = {**vars(PagedDecodeShape()), "dtype": "bf16", "bytes": moved}
    text = targets.format_paged_decode({"config": config, "columns": columns})
    assert len(text.splitlines()) == 2 + len(timings)
    assert "1.0e-03" in text and "90.9%" in text


def test_format_naive():
    timings = {name: _timing(us) for name, us in (("naive (3 kernels)", 100.0), ("cudnn_attn.sdpa", 25.0))}
    row = {
        "calls_per_block": 50,
        "timings": timings,
        "speedup_over_naive": {"cudnn_attn.sdpa": 4.0},
        "rel_err": {"naive (3 kernels)": 1e-3, "cudnn_attn.sdpa": 2e-3},
    }
    config = {"batch": 4, "heads": 16, "head_dim": 64, "dtype": "fp16", "causal": False}
    text = targets.format_naive({"config": config, "seqs": {"512": row}})
    assert "S=512 (50 calls per block)" in text and "4.00x" in text


def test_bench_help_lists_the_sections(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["bench", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert all(flag in text for flag in ("--stack", "--paged-decode", "--naive", "--models", "--mla"))


@pytest.fixture
def recorded_run(monkeypatch):
    """``bench.run`` replaced by a recorder, on a machine that claims a GPU."""
    calls: list[tuple[list, dict]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(versions, "cudnn_missing", lambda: None)  # and a loadable cuDNN
    monkeypatch.setattr(attention, "run", lambda shapes, **kw: calls.append((shapes, kw)))
    return calls


def test_sections_alone_skip_the_default_shape(recorded_run):
    assert cli.main(["bench", "--stack", "--naive"]) == 0
    shapes, kw = recorded_run[0]
    assert shapes == [] and kw["stack"] and kw["naive"] and not kw["paged_decode"]


def test_plain_bench_still_runs_the_default_shape(recorded_run):
    assert cli.main(["bench", "--overhead"]) == 0
    shapes, kw = recorded_run[0]
    assert len(shapes) == 1 and kw["overhead"] and not (kw["stack"] or kw["paged_decode"] or kw["naive"])
    assert cli.main(["bench", "b=1,h=2,s=64,d=64", "--paged-decode"]) == 0
    shapes, kw = recorded_run[1]
    assert [s.label() for s in shapes] == ["b1-h2-s64-d64-bf16"] and kw["paged_decode"]


def test_run_reports_and_prints_each_section(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "test GPU")
    monkeypatch.setattr(targets, "naive_vs_fused", lambda: {"seqs": {}})
    monkeypatch.setattr(targets, "format_naive", lambda r: "naive section printed")
    path = tmp_path / "report.json"
    report = attention.run([], json_path=str(path), plot_path=None, overhead=False, cold=False, naive=True)
    assert report["naive"] == {"seqs": {}} and "stack" not in report and "paged_decode" not in report
    assert "naive section printed" in capsys.readouterr().out
    assert json.loads(path.read_text())["naive"] == {"seqs": {}}


def test_rounds_shuffle_the_order_of_columns():
    """No column always follows the same one (a light predecessor leaves the GPU's clocks up)."""
    from cudnn_attn.bench.host import round_order

    names = ["a", "b", "c", "d", "e", "f"]
    orders = [round_order(names, r) for r in range(30)]
    assert all(sorted(order) == names for order in orders)
    predecessors = {order[order.index("a") - 1] for order in orders if order[0] != "a"}
    assert len(predecessors) >= 3
    assert orders == [round_order(names, r) for r in range(30)]  # seeded: a rerun times the same orders


def test_model_shapes_count_flops_as_the_frontends_benchmark():
    """The frontend's published H200 row (gpt_oss, B2 H64/8 d64, window 1024, S 32k): fwd 3.021 ms
    is 358 TFLOP/s and bwd 9.045 ms 299 TFLOP/s in its CSV; DeepSeek-V3 at 4k counts the causal
    triangle with its diagonal."""
    from cudnn_attn.bench.model_shapes import MODELS

    by_name = {m.name: m for m in MODELS}
    oss = by_name["gpt-oss"]
    assert round(oss.flops(32768, False) / 3.021e-3 / 1e12) == 358
    assert round(oss.flops(32768, True) / 9.045e-3 / 1e12) == 299
    dsv3 = by_name["deepseek-v3"]
    assert dsv3.flops(4096, False) == 2.0 * 128 * (4096 * 4097 // 2) * (192 + 128)
    assert by_name["gpt-oss+sinks"].sinks and not oss.sinks
