"""How many pages the Triton decode kernel loads a step: a count of tokens (64 with two programs
an SM or more, else 128), so that pages of 16 or 32 tokens do not shrink its tiles."""

from __future__ import annotations

import pytest
import torch

from cudnn_attn.kernels import paged_decode


@pytest.fixture
def sms_132(monkeypatch):
    monkeypatch.setattr(paged_decode, "sm_count", lambda device: 132)
    return torch.device("cuda", 0)


@pytest.mark.parametrize("page,many,few", [(16, 4, 8), (32, 2, 4), (64, 1, 2), (128, 1, 1), (256, 1, 1)])
def test_a_step_is_a_count_of_tokens(sms_132, page, many, few):
    assert paged_decode.default_pages_per_step(264, page, sms_132) == many  # two programs an SM
    assert paged_decode.default_pages_per_step(263, page, sms_132) == few
