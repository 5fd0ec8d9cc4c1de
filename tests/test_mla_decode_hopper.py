"""Which calls the warp-specialised MLA kernel takes: the cache's rows as TMA addresses them."""

from __future__ import annotations

import torch

from cudnn_attn.kernels.mla_decode_hopper import _rows, usable


def test_a_contiguous_cache_is_one_row_per_token_in_either_layout():
    nhpd = torch.arange(3 * 64 * 576, dtype=torch.float32).view(3, 1, 64, 576).bfloat16()
    rows = _rows(nhpd, token=2)
    assert rows.shape == (3 * 64, 576) and rows.data_ptr() == nhpd.data_ptr()
    assert torch.equal(rows[64 + 5], nhpd[1, 0, 5])
    nphd = nhpd.view(3, 64, 1, 576)
    assert torch.equal(_rows(nphd, token=1)[2 * 64 + 63], nphd[2, 63, 0])


def test_a_cache_whose_pages_are_not_back_to_back_is_left_to_the_triton_kernel():
    padded = torch.zeros(3, 1, 80, 576, dtype=torch.bfloat16)[:, :, :64]  # 16 spare rows per page
    assert _rows(padded, token=2) is None
    odd_rows = torch.zeros(3, 1, 64, 580, dtype=torch.bfloat16)[..., :576]  # 1160-byte rows: TMA needs 16
    assert _rows(odd_rows, token=2) is None


def test_cpu_tensors_are_not_served():
    q = torch.zeros(1, 16, 1, 576, dtype=torch.bfloat16)
    cache = torch.zeros(2, 1, 64, 576, dtype=torch.bfloat16)
    assert not usable(q, cache, cache[..., :512], "NHPD")
