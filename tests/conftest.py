"""Shared test helpers: relative error, tolerances, poisoning, GPU skipping."""

from __future__ import annotations

import pytest
import torch

import cudnn_attn

# Relative-error tolerances by the dtype the data passed through.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5, torch.float64: 1e-10}
# The reference computes in float32; compared with float64 on the same (upcast) inputs.
REFERENCE_TOL = 2e-5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||a - e|| / ||e|| in float64, ignoring positions where both are -inf; NaN never passes."""
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    assert a.shape == e.shape, f"shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not torch.isnan(a).any(), "NaN in result"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), "infinities differ"
    a, e = a.masked_fill(inf_a, 0.0), e.masked_fill(inf_e, 0.0)
    denom = e.norm()
    return float((a - e).norm() / (denom if denom > 0 else 1.0))


def randn(*shape, dtype=torch.bfloat16, device="cpu", generator=None):
    return torch.randn(*shape, dtype=torch.float32, generator=generator).to(device=device, dtype=dtype)


def poisoned(handle) -> torch.Tensor:
    """An output buffer with ``handle``'s geometry, filled with NaN so unwritten elements show."""
    spec = handle.spec
    t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=spec.device)
    return t.fill_(float("nan"))


def split_options(options: dict, dtype, generator) -> tuple[dict, dict]:
    """A test case's option dict as (sdpa keywords, oracle keywords): ``padding`` becomes
    per-batch length tensors, ``bias`` a random bias of that shape; the rest passes through."""
    options = dict(options)
    kwargs, oracle_kwargs = {}, {}
    if "padding" in options:
        lq, lkv = options.pop("padding")
        kwargs.update(
            use_padding_mask=True,
            seq_len_q=torch.tensor(lq, dtype=torch.int32),
            seq_len_kv=torch.tensor(lkv, dtype=torch.int32),
        )
        oracle_kwargs.update(seq_q=lq, seq_kv=lkv)
    if "bias" in options:
        kwargs["attn_bias"] = oracle_kwargs["bias"] = randn(*options.pop("bias"), dtype=dtype, generator=generator)
    kwargs.update(options)
    return kwargs, oracle_kwargs


@pytest.fixture
def cache():
    """A private plan cache per test, so counts are the test's own."""
    return cudnn_attn.PlanCache(maxsize=64)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
