"""``bench --batching``'s measure on a tiny workload on the CPU: both columns serve every request
and, in float32, agree on every greedy token, as sdpa does with itself over other batches (the
GPU's bf16 figures are the benchmark's)."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "ContinuousBatchingConfig"):
    pytest.skip("this transformers has no continuous batching config", allow_module_level=True)

from cudnn_attn.bench import batching  # noqa: E402


def test_both_columns_serve_every_request_with_the_same_greedy_tokens(monkeypatch):
    monkeypatch.setattr(batching, "OTHER_BATCH_TOKENS", 4)  # sdpa's own second run in other batches
    sizes = []  # the batch size of every run, as transformers is given it

    class Recorded(transformers.ContinuousBatchingConfig):
        def __init__(self, *args, **kwargs):
            sizes.append(kwargs.get("max_batch_tokens"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", Recorded)
    tiny = batching.Workload(
        requests=3, shortest=2, longest=7, new_tokens=3, hidden=32, layers=1, heads=4, kv_heads=2, vocab=64
    )
    result = batching.measure(tiny, device="cpu", rounds=1)
    assert set(result["columns"]) == {"sdpa", "cudnn_attn"}
    assert all(c["tokens_per_s"] > 0 for c in result["columns"].values())
    assert result["tokens_equal"] == 1.0 and result["requests_equal"] == 1.0
    assert result["sdpa_self"]["tokens_equal"] == 1.0  # float32: other batches, the same tokens
    assert result["sdpa_self"]["batch_tokens"] == 4 and sizes.count(4) == 1 and set(sizes) == {4, batching.BATCH_TOKENS}
    text = batching.format_batching(result)
    assert "cudnn_attn / sdpa" in text and "sdpa against itself over batches of 4 tokens" in text
