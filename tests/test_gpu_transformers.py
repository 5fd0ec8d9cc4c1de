"""The transformers integration on a GPU (cuDNN): the checks of test_transformers_integration.py on
CUDA in bf16, against transformers' "sdpa" (torch's own CUDA kernels) with the same weights."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from test_transformers_integration import (  # noqa: E402
    CONFIGS,
    PADDINGS,
    WINDOW_CASES,
    calls,  # noqa: F401  (the fixture)
    check_dropout,
    check_generation,
    check_gradients,
    check_logits,
    check_packed,
    check_window,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_sdpa_on_gpu(name, padding, calls):  # noqa: F811
    check_logits(name, padding, "cuda", calls)


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_step_gradients_match_sdpa_on_gpu(name, padding):
    check_gradients(name, padding, "cuda")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_sdpa_on_gpu(name, cache):
    check_generation(name, cache, "cuda")


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_with_attention_dropout_on_gpu(name, padding, calls):  # noqa: F811
    check_dropout(name, padding, "cuda", calls)


@pytest.mark.parametrize("route", ["mask", "position_ids", "collator_kwargs"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_batch_matches_sequences_run_alone_on_gpu(name, route, calls):  # noqa: F811
    check_packed(name, route, "cuda", calls)


@pytest.mark.parametrize("case", list(WINDOW_CASES))
@pytest.mark.parametrize("window", [1, 2, 4])
def test_sliding_window_follows_transformers_convention_on_gpu(window, case):
    check_window(window, *WINDOW_CASES[case], "cuda")
