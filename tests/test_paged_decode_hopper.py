"""Which calls the warp-specialised GQA decode kernel takes: the caches' token rows as one TMA
descriptor addresses them, in either layout and in an engine's combined K/V tensor; which steps
the schedule gives it, and their split."""

from __future__ import annotations

import math

import pytest
import torch

from cudnn_attn.kernels.paged_decode_hopper import default_stages, tensors_fit, tile_rows, token_rows, usable
from cudnn_attn.kernels.strides import strides_alike
from cudnn_attn.ops.dispatch import DECODE_KERNELS
from cudnn_attn.serving import schedule as paged_schedule
from cudnn_attn.serving import step

TRITON = DECODE_KERNELS["triton"]


def _row_of(rows, page, head, token):
    """The elements ``token_rows`` says hold (page, head, token)."""
    r = page * rows.row_page + head * rows.row_head + token
    return rows.view[r, head * rows.col_head : head * rows.col_head + 128]


def test_nhpd_pages_are_heads_of_whole_rows():
    cache = torch.randn(3, 8, 64, 128).bfloat16()
    rows = token_rows(cache, "NHPD")
    assert (rows.row_page, rows.row_head, rows.col_head) == (8 * 64, 64, 0)
    assert rows.view.data_ptr() == cache.data_ptr()
    assert torch.equal(_row_of(rows, 2, 5, 17), cache[2, 5, 17])


def test_nphd_heads_sit_side_by_side_in_a_token_row():
    cache = torch.randn(3, 64, 8, 128).bfloat16()
    rows = token_rows(cache, "NPHD")
    assert (rows.row_page, rows.row_head, rows.col_head) == (64, 0, 128)
    assert torch.equal(_row_of(rows, 1, 7, 63), cache[1, 63, 7])


def test_an_engines_combined_kv_tensor_is_read_in_place():
    kv = torch.randn(2, 5, 64, 4, 128).bfloat16()  # [K/V, blocks, block size, heads, dim], NPHD halves
    k_rows, v_rows = token_rows(kv[0], "NPHD"), token_rows(kv[1], "NPHD")
    assert k_rows.view.data_ptr() == kv[0].data_ptr() and v_rows.view.data_ptr() == kv[1].data_ptr()
    assert torch.equal(_row_of(v_rows, 4, 3, 10), kv[1, 4, 10, 3])


def test_caches_tma_cannot_address_are_left_to_the_triton_kernel():
    odd_rows = torch.zeros(3, 8, 64, 132).bfloat16()[..., :128]  # 264-byte rows: TMA needs 16-byte multiples
    assert token_rows(odd_rows, "NHPD") is None
    strided_dim = torch.zeros(3, 8, 64, 256).bfloat16()[..., ::2]
    assert token_rows(strided_dim, "NHPD") is None
    page_padded = torch.zeros(3, 64 * 1024 + 8).bfloat16()[:, : 64 * 1024].view(3, 64, 8, 128)  # pages 8 elements apart
    assert token_rows(page_padded, "NPHD") is None


def _tensors(heads=32, kv_heads=8, s_q=1, dim=128, page=64, dtype=torch.bfloat16, kv_dtype=None):
    q = torch.zeros(2, heads, s_q, dim, dtype=dtype)
    cache = torch.zeros(2, 5, kv_heads, page, dim, dtype=kv_dtype or dtype)  # K and V, NHPD
    return q, cache[0], cache[1]


def test_the_tensors_the_kernel_takes():
    assert tensors_fit(*_tensors(), "NHPD")
    assert tensors_fit(*_tensors(dtype=torch.float16, dim=64, page=256), "NHPD")
    assert tensors_fit(*_tensors(heads=64, s_q=8), "NHPD")  # 64 rows: one tile
    assert tensors_fit(*_tensors(page=16), "NHPD") and tensors_fit(*_tensors(page=32), "NHPD")


@pytest.mark.parametrize(
    "why,tensors",
    [
        ("FP8 caches", _tensors(kv_dtype=torch.float8_e4m3fn)),
        ("float32", _tensors(dtype=torch.float32)),
        ("65 rows", _tensors(heads=40, kv_heads=8, s_q=13)),
        ("page 8", _tensors(page=8)),
        ("head dim 96", _tensors(dim=96)),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_tensors_the_kernel_cannot_take_go_to_the_triton_form(why, tensors):
    assert not tensors_fit(*tensors, "NHPD"), why


def test_caches_of_other_shapes_strides_or_alignment_are_refused():
    q, k, v = _tensors()
    assert not tensors_fit(q, k, v[:, :, :32], "NHPD")  # V not K's shape
    assert not tensors_fit(q, k, v.transpose(1, 2).contiguous().transpose(1, 2), "NHPD")  # V's strides
    assert not tensors_fit(torch.zeros(2, 32, 1, 256, dtype=q.dtype)[..., ::2], k, v, "NHPD")  # q's dim strided
    assert not tensors_fit(q, k[..., :64], v[..., :64], "NHPD")  # K's head dim not q's
    shifted = torch.zeros(5 * 8 * 64 * 128 + 1, dtype=torch.bfloat16)[1:].view(5, 8, 64, 128)
    assert not tensors_fit(q, k, shifted, "NHPD")  # V's base not 16-byte aligned
    assert token_rows(k.expand(5, 8, 64, 128).as_strided((5, 8, 64, 128), (0, 0, 0, 1)), "NHPD") is None


def test_one_kv_heads_caches_may_differ_in_the_head_dims_stride():
    """With one K/V head the head index is always 0: a V whose size-1 head dim has another stride
    (a token-major tensor's transpose, which torch calls contiguous) is walked as K is."""
    q, k, v = _tensors(heads=8, kv_heads=1)
    v_token_major = torch.empty_like(v.transpose(1, 2), memory_format=torch.contiguous_format)
    v_token_major = v_token_major.copy_(v.transpose(1, 2)).transpose(1, 2)
    assert v_token_major.stride() != k.stride() and strides_alike(v_token_major, k)
    assert tensors_fit(q, k, v_token_major, "NHPD")
    wider_pages = torch.zeros(5, 1, 128, 128, dtype=k.dtype)[:, :, :64]  # K's shape, pages further apart
    assert not strides_alike(wider_pages, k) and not tensors_fit(q, k, wider_pages, "NHPD")


@pytest.mark.parametrize("layout", ["NHPD", "NPHD"])
@pytest.mark.parametrize("pages", [1, 3])
def test_k_s_addressing_reads_v_where_only_size_1_strides_differ(layout, pages):
    """The Hopper kernel builds V's descriptor from V's rows but steps through them with K's
    page and head offsets: with one K/V head (and, for one page, any page stride) those land on
    V's own elements wherever ``tensors_fit`` takes the pair."""
    shape = (pages, 1, 64, 128) if layout == "NHPD" else (pages, 64, 1, 128)
    k = torch.arange(math.prod(shape), dtype=torch.float32).to(torch.bfloat16).view(shape)
    head = 1 if layout == "NHPD" else 2
    odd = list(k.stride())
    odd[head] = 128 if odd[head] != 128 else 64 * 128  # the size-1 head dim's stride, changed
    if pages == 1:
        odd[0] = 7 * 64 * 128  # one page: its stride is never stepped along either
    v = torch.empty(pages * 7 * 64 * 128 + 64 * 128, dtype=torch.bfloat16).as_strided(shape, odd)
    v.copy_(-k)
    q = torch.zeros(2, 4, 1, 128, dtype=torch.bfloat16)
    assert v.stride() != k.stride() and tensors_fit(q, k, v, layout)
    k_rows, v_rows = token_rows(k, layout), token_rows(v, layout)
    for page, token in [(0, 0), (pages - 1, 17), (pages - 1, 63)]:
        at = _row_of(v_rows._replace(row_page=k_rows.row_page, row_head=k_rows.row_head), page, 0, token)
        want = v[page, 0, token] if layout == "NHPD" else v[page, token, 0]
        assert torch.equal(at, want)


def test_cpu_tensors_are_not_served():
    q = torch.zeros(1, 32, 1, 128, dtype=torch.bfloat16)
    cache = torch.zeros(2, 8, 64, 128, dtype=torch.bfloat16)
    assert not usable(q, cache, cache, "NHPD")


def test_the_ring_holds_as_many_steps_as_its_shared_memory_allows():
    assert default_stages(64) == 3 and default_stages(128) == 3 and default_stages(256) == 2


@pytest.mark.parametrize(
    "batch,pages,expected_splits",
    [(1, 32, 16), (1, 512, 16), (4, 128, 4), (8, 512, 2), (16, 64, 1)],
)
def test_the_hopper_form_splits_into_one_wave_where_the_heads_fit_the_sms(batch, pages, expected_splits):
    """Page 64, 32 query / 8 K/V heads, 132 SMs: one program per SM at most (a power of two of
    chunks, none under 128 tokens)."""
    schedule = paged_schedule.choose(batch, pages, 64, 32, 8, 1, kernel=TRITON, hopper=True)
    assert schedule.hopper and schedule.splits == expected_splits
    assert batch * 8 * schedule.splits <= 132


@pytest.mark.parametrize("page", [16, 32])
def test_small_pages_follow_the_one_wave_rule(page):
    """Over pages of 16 or 32 the Hopper form takes the steps whose heads fit one wave, as over
    pages of 64; batch 64 over 4k (512 heads) keeps the Triton form, whose steps span pages."""
    assert paged_schedule.choose(4, 8192 // page, page, 32, 8, 1, kernel=TRITON, hopper=True).hopper
    assert not paged_schedule.choose(64, 4096 // page, page, 32, 8, 1, kernel=TRITON, hopper=True).hopper


def test_more_heads_than_sms_fp8_caches_and_mla_keep_the_triton_form():
    assert not paged_schedule.choose(64, 64, 64, 32, 8, 1, kernel=TRITON, hopper=True).hopper  # 512 heads
    assert not paged_schedule.choose(1, 512, 64, 32, 8, 1, kernel=TRITON, hopper=True, fp8=True).hopper
    assert not paged_schedule.choose(1, 512, 64, 16, 1, 1, kernel=TRITON, hopper=True, mla=True).hopper
    assert not paged_schedule.choose(1, 512, 64, 32, 8, 1, kernel=TRITON).hopper
    assert not paged_schedule.choose(1, 512, 64, 32, 8, 1, hopper=True).hopper  # cuDNN's calls


def _tables(monkeypatch, **options):
    """A captured step's tables with the kernels' facts of an sm_90 GPU with Triton and Gluon."""
    monkeypatch.setattr(step.paged_decode, "supported", lambda device, page, dim: True)
    monkeypatch.setattr(step.paged_decode_hopper, "serves", lambda device, page, dim, rows: rows <= 64)
    monkeypatch.setattr(step, "sm_count", lambda device: 132)
    heads = options.pop("heads", (32, 8, 128))
    return step.StepTables(*heads, 64, buffers=step.StepBuffers(True), splits=None, pack=None, kernel=None, **options)


def test_a_steps_hopper_fact_reaches_its_schedule(monkeypatch):
    cuda = torch.device("cuda", 0)
    schedule = _tables(monkeypatch)._schedule(1, 512, 1, cuda)
    assert schedule.kernel == "triton" and schedule.hopper and schedule.splits == 16
    assert _tables(monkeypatch)._schedule(2, 64, 16, cuda).hopper  # 4 heads by 16 tokens: 64 rows
    assert not _tables(monkeypatch, fp8_caches=True)._schedule(1, 512, 1, cuda).hopper
    assert not _tables(monkeypatch, heads=(16, 1, 576), head_dim_v=512)._schedule(1, 512, 1, cuda).hopper  # MLA


@pytest.mark.parametrize(
    ("rows", "tile"),
    [
        (1, (8, True)),
        (4, (8, True)),
        (8, (8, True)),
        (9, (16, True)),
        (16, (16, True)),
        (17, (64, False)),
        (64, (64, False)),
    ],
)
def test_few_query_rows_are_wgmmas_columns_and_many_its_64_rows(rows, tile):
    """Up to 16 query rows (a group of 4 by up to 4 tokens) the products are turned over, the
    rows padded to 8 or 16 columns; past 16 (measured slower turned over, 32 rows on an H200)
    they fill one 64-row tile."""
    assert tile_rows(rows) == tile
