"""Hugging Face transformers with attn_implementation="cudnn_attn" against its "sdpa": tiny random
models in bf16 (a Llama, and a Qwen2 with one full and one sliding-window layer), padded, packed,
training and generating. The checks take a device; test_gpu_transformers.py runs them on CUDA."""

from __future__ import annotations

import collections
import copy
import inspect
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from conftest import TOLERANCE, randn, rel_err  # noqa: E402
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, LlamaConfig, Qwen2Config  # noqa: E402
from transformers import masking_utils as mu  # noqa: E402

import cudnn_attn.integrations.transformers as cudnn_hf  # noqa: E402
from cudnn_attn import UnsupportedError  # noqa: E402

NAME = cudnn_hf.register()
TOL = TOLERANCE[torch.bfloat16]
GRAD_TOL = 3e-2  # the backward's own bf16 tolerance (tests/test_gpu_cudnn.py)
VOCAB, WINDOW, LAYERS = 128, 4, 2

CONFIGS = {
    "llama": lambda: LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
    # One full and one sliding layer; sequences below are longer than the window.
    "qwen2-sliding": lambda: Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        use_sliding_window=True,
        sliding_window=WINDOW,
        layer_types=["full_attention", "sliding_attention"],
    ),
}
PADDINGS = {"none": [0, 0, 0], "left": [5, 2, 0], "right": [0, 4, 1]}


def make_models(name: str, device: str = "cpu", seed: int = 0):
    """The same random weights twice: transformers' sdpa, and cudnn_attn."""
    torch.manual_seed(seed)
    ref = AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation="sdpa", dtype=torch.bfloat16)
    ref = ref.to(device).eval()
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(NAME)
    assert ours.config._attn_implementation == NAME and ref.config._attn_implementation == "sdpa"
    return ref, ours


def batch(padding: str, device: str = "cpu", length: int = 12, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (3, length), generator=g)
    mask = torch.ones(3, length, dtype=torch.long)
    for row, pad in enumerate(PADDINGS[padding]):
        if padding == "left":
            mask[row, :pad] = 0
        elif padding == "right":
            mask[row, length - pad :] = 0
    return ids.to(device), mask.to(device)


@pytest.fixture
def calls(monkeypatch):
    """Counts which cudnn_attn door each layer took: varlen, dense sdpa, or sdpa with a dense mask."""
    counts: collections.Counter = collections.Counter()
    varlen, sdpa = cudnn_hf.varlen_attention, cudnn_hf.sdpa

    def counted_varlen(*args, **kwargs):
        counts["varlen"] += 1
        return varlen(*args, **kwargs)

    def counted_sdpa(*args, **kwargs):
        counts["dense_mask" if kwargs.get("attn_mask") is not None else "sdpa"] += 1
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(cudnn_hf, "varlen_attention", counted_varlen)
    monkeypatch.setattr(cudnn_hf, "sdpa", counted_sdpa)
    return counts


# --- checks shared with the GPU tests ---------------------------------------------------------


def check_logits(name: str, padding: str, device: str, counts=None) -> None:
    ref, ours = make_models(name, device)
    ids, mask = batch(padding, device)
    with torch.no_grad():
        expected = ref(ids, attention_mask=mask).logits
        actual = ours(ids, attention_mask=mask).logits
    real = mask.bool()
    assert torch.isfinite(actual).all()
    err = rel_err(actual[real], expected[real])
    assert err < TOL, f"logits: rel_err {err:.3e}"
    if counts is not None:  # padding goes through varlen as lengths, never as a dense mask
        assert counts["dense_mask"] == 0
        # an unpadded sliding layer is one dense call with window_size, as every unpadded layer
        assert counts["varlen"] == (LAYERS if padding != "none" else 0)


def check_gradients(name: str, padding: str, device: str) -> None:
    ref, ours = make_models(name, device)
    ids, mask = batch(padding, device)
    labels = ids.masked_fill(mask == 0, -100)
    # A row's first real token is predicted from the position before it: with left padding, a
    # padding position, whose attention output is undefined (every key masked: zeros here and
    # in FlashAttention's path, something else in sdpa's kernels). Its term is left out.
    labels[torch.arange(ids.shape[0], device=ids.device), mask.argmax(dim=1)] = -100
    losses = []
    for model in (ref, ours):
        model.train()
        loss = model(ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        losses.append(loss.detach())
    assert rel_err(losses[1], losses[0]) < TOL
    for (key, p_ref), (_, p_ours) in zip(ref.named_parameters(), ours.named_parameters()):
        if key.endswith("k_proj.bias"):  # its exact gradient is zero (softmax ignores a shift shared by all keys)
            continue
        assert p_ours.grad is not None and torch.isfinite(p_ours.grad).all(), key
        err = rel_err(p_ours.grad, p_ref.grad)
        assert err < GRAD_TOL, f"{key}: gradient rel_err {err:.3e}"


def check_generation(name: str, cache: str, device: str, seed: int = 3) -> None:
    """Greedy decoding with a KV cache: the same tokens, and every step's logits within tolerance.
    Random weights leave near-ties; a token may differ only where the reference's top-two gap is
    within the logits' difference at that step (never the case for this seed on the CPU)."""
    ref, ours = make_models(name, device, seed)
    ids, mask = batch("left", device, length=9, seed=seed)
    settings = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    if cache == "static":
        settings["cache_implementation"] = "static"
    out = [model.generate(ids, attention_mask=mask, **settings) for model in (ref, ours)]
    prompt = ids.shape[1]
    for step, (expected, actual) in enumerate(zip(out[0].logits, out[1].logits)):
        err = rel_err(actual, expected)
        assert err < TOL, f"step {step}: logits rel_err {err:.3e}"
        same = out[0].sequences[:, prompt + step] == out[1].sequences[:, prompt + step]
        if not same.all():
            top2 = expected.float().topk(2).values
            gap = (top2[:, 0] - top2[:, 1])[~same]
            noise = (actual.float() - expected.float()).abs().amax(dim=-1)[~same]
            assert (gap <= 2 * noise).all(), f"step {step}: tokens differ without a near-tie (gap {gap.tolist()})"
            return
    assert torch.equal(out[0].sequences, out[1].sequences)


def check_packed(name: str, route: str, device: str, counts=None) -> None:
    """Padding-free packing (sequences back to back in one row) equals the sequences run alone."""
    ref, ours = make_models(name, device)
    g = torch.Generator().manual_seed(2)
    lengths = [5, 9, 3, 7]
    sequences = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in lengths]
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": s} for s in sequences])
    packed = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in packed.items()}
    inputs = {"input_ids": packed["input_ids"], "position_ids": packed["position_ids"]}
    if route == "mask":  # transformers' mask code finds the runs (no cache)
        inputs["use_cache"] = False
    elif route == "position_ids":  # a cache: found in the layers' position_ids, as transformers' FlashAttention does
        inputs["use_cache"] = True
    else:  # DataCollatorWithFlattening's cu_seq_lens_q/k, max_length_q/k
        inputs.update({k: packed[k] for k in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")})
        inputs["use_cache"] = True
    with torch.no_grad():
        expected = torch.cat([ref(torch.tensor([s], device=device)).logits for s in sequences], dim=1)
        if counts is not None:
            counts.clear()
        actual = ours(**inputs).logits
    err = rel_err(actual, expected)
    assert err < TOL, f"packed logits: rel_err {err:.3e}"
    if counts is not None:
        assert counts["varlen"] == LAYERS and counts["sdpa"] == counts["dense_mask"] == 0


def check_dropout(name: str, padding: str, device: str, counts=None) -> None:
    """Training with attention dropout: drawn from torch's generator (the same seed, the same
    result; another seed, another), and it reaches the loss's gradients."""
    _, ours = make_models(name, device)
    for layer in ours.model.layers:
        layer.self_attn.attention_dropout = 0.3
    ids, mask = batch(padding, device)
    real = mask.bool()
    with torch.no_grad():
        plain = ours(ids, attention_mask=mask).logits[real]  # eval: no dropout
    ours.train()
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        logits = ours(ids, attention_mask=mask).logits
        runs.append(logits[real])
    logits[real].float().square().mean().backward()
    assert torch.equal(runs[0], runs[1])
    assert not rel_err(runs[2], runs[0]) < TOL and not rel_err(runs[0], plain) < TOL
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ours.parameters() if p.requires_grad)
    if counts is not None:
        assert counts["varlen"] + counts["sdpa"] == 4 * LAYERS and counts["dense_mask"] == 0  # 4 forwards


def check_window(window: int, queries: int, padding: str, device: str) -> None:
    """One layer against transformers' own sliding-window mask function (query i, key j: j <= i
    and j > i - window), in float32: the window lets ``window`` tokens through, the query's own included."""
    g = torch.Generator().manual_seed(window * 10 + queries)
    batch_size, heads, kv_heads, keys, dim = 3, 4, 2, 11, 16
    q = randn(batch_size, heads, queries, dim, generator=g).to(device)
    k, v = (randn(batch_size, kv_heads, keys, dim, generator=g).to(device) for _ in range(2))
    real = torch.ones(batch_size, keys, dtype=torch.bool)
    if padding == "left":
        real[0, :3], real[1, :1] = False, False
    elif padding == "right":
        real[0, 8:], real[1, 10:] = False, False
    real = real.to(device)
    q_pos = torch.arange(keys - queries, keys, device=device)[:, None]
    allowed = mu.sliding_window_causal_mask_function(window)(0, 0, q_pos, torch.arange(keys, device=device)[None])
    expected = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=allowed & real[:, None, None], enable_gqa=True
    ).transpose(1, 2)
    layer = torch.nn.Module()
    layer.is_causal = True
    mask = None if padding == "none" else real
    rows = real[:, keys - queries :]

    def run(sliding_window):
        out, weights = cudnn_hf.attention_forward(layer, q, k, v, mask, sliding_window=sliding_window)
        assert weights is None and out.shape == (batch_size, queries, heads, dim)
        return out

    out = run(window)
    err = rel_err(out[rows], expected[rows])
    assert err < TOL, f"window {window}: rel_err {err:.3e}"
    assert bool((out[~rows] == 0).all()), "padded query rows must be zero"
    # The check tells the window from its neighbours (an off-by-one would fail it).
    for other in (window - 1, window + 1):
        if other >= 1 and other < keys:
            assert not rel_err(run(other)[rows], expected[rows]) < 5 * TOL, f"window {other} passes for {window}"


# --- CPU tests --------------------------------------------------------------------------------


def test_importing_cudnn_attn_does_not_import_transformers():
    code = "import sys, cudnn_attn, cudnn_attn.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_sdpa(name, padding, calls):
    check_logits(name, padding, "cpu", calls)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_step_gradients_match_sdpa(name):
    check_gradients(name, "left", "cpu")


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_generation_matches_sdpa(name, cache):
    check_generation(name, cache, "cpu")


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_training_with_attention_dropout(name, padding, calls):
    check_dropout(name, padding, "cpu", calls)


@pytest.mark.parametrize("padding", ["none", "left"])
def test_dropout_keeps_the_expected_output(padding):
    """Averaged over draws, dropout's output is the output without it (kept weights rescaled)."""
    layer = torch.nn.Module()
    layer.is_causal = True
    g = torch.Generator().manual_seed(0)
    q, k, v = randn(2, 4, 6, 16, generator=g), randn(2, 2, 6, 16, generator=g), randn(2, 2, 6, 16, generator=g)
    real = torch.ones(2, 6, dtype=torch.bool)
    real[0, :2] = False
    mask = real if padding == "left" else None
    plain, _ = cudnn_hf.attention_forward(layer, q, k, v, mask)
    torch.manual_seed(0)
    draws = torch.stack([cudnn_hf.attention_forward(layer, q, k, v, mask, dropout=0.3)[0].float() for _ in range(48)])
    assert not rel_err(draws[0][real], plain[real]) < 0.3  # one draw is far off
    assert rel_err(draws.mean(0)[real], plain[real]) < 0.2  # unscaled, the mean would be 30% short


@pytest.mark.parametrize("route", ["mask", "position_ids", "collator_kwargs"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_packed_batch_matches_sequences_run_alone(name, route, calls):
    check_packed(name, route, "cpu", calls)


# (queries, padding) of 11 keys: a prefill, a chunk of 3 and one decoded token after a cached prefix.
WINDOW_CASES = {
    "prefill": (11, "none"),
    "prefill-left": (11, "left"),
    "prefill-right": (11, "right"),
    "chunk": (3, "none"),
    "chunk-left": (3, "left"),
    "decode": (1, "none"),
    "decode-left": (1, "left"),
}


@pytest.mark.parametrize("case", list(WINDOW_CASES))
@pytest.mark.parametrize("window", [1, 2, 4])
def test_sliding_window_follows_transformers_convention(window, case):
    check_window(window, *WINDOW_CASES[case], "cpu")


def test_set_attn_implementation_switches_both_ways(calls):
    ref, _ = make_models("llama")
    ids, mask = batch("left")
    with torch.no_grad():
        before = ref(ids, attention_mask=mask).logits
        ref.set_attn_implementation(NAME)
        ours = ref(ids, attention_mask=mask).logits
        assert calls["varlen"] == LAYERS
        ref.set_attn_implementation("sdpa")
        after = ref(ids, attention_mask=mask).logits
    assert calls["varlen"] == LAYERS, "sdpa again: cudnn_attn must not run"
    assert torch.equal(after, before)
    real = mask.bool()
    assert rel_err(ours[real], before[real]) < TOL
    built = AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation=NAME, dtype=torch.bfloat16)
    assert built.config._attn_implementation == NAME


def encoder_models(layers: int) -> tuple:
    """A tiny random BERT (its encoder: padding masks) and BART (a decoder's cross-attention)."""
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, max_position_embeddings=64)
    bert = transformers.BertModel(
        transformers.BertConfig(
            hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=128, **common
        ),
        add_pooling_layer=False,
    )
    bart = transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            d_model=64,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            **common,
        )
    )
    return bert, bart


def encoder_errors(dtype: torch.dtype, layers: int) -> dict[str, float]:
    """BERT's padded encoder output and BART's logits (cross-attention to it) in ``dtype``: ours
    against sdpa on the same weights, relative error by model."""
    ids, mask = batch("right")
    bert, bart = encoder_models(layers)
    errors = {}
    for model, run, rows in (
        (bert, lambda m: m(ids, attention_mask=mask).last_hidden_state, mask.bool()),
        (bart, lambda m: m(ids, attention_mask=mask, decoder_input_ids=ids[:, :7]).logits, slice(None)),
    ):
        model = model.to(dtype).eval()
        model.set_attn_implementation("sdpa")
        ours = copy.deepcopy(model)
        ours.set_attn_implementation(NAME)
        with torch.no_grad():
            errors[type(model).__name__] = rel_err(run(ours)[rows], run(model)[rows])
    return errors


def test_bidirectional_and_cross_attention_match_sdpa(calls):
    """Masks without causality: a padded encoder (BERT), and a decoder's cross-attention to it (BART)."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("BERT and BART build their masks with transformers' mask registry from transformers 5 on")
    for name, err in encoder_errors(torch.bfloat16, LAYERS).items():
        assert err < TOL, f"{name}: rel_err {err:.3e}"
    # BERT's two layers and BART's encoder layer and cross-attention unpad; BART's decoder is unpadded
    assert calls["varlen"] == LAYERS + 2 and calls["dense_mask"] == 0


def test_dense_mask_passed_in_goes_to_sdpa(calls):
    """A 4-D mask (here a prefix seen both ways, then causal) is a dense mask, as for sdpa."""
    ref, ours = make_models("llama")
    ids, _ = batch("none")
    allowed = torch.ones(12, 12, dtype=torch.bool).tril()
    allowed[:4, :4] = True
    mask = allowed.expand(3, 1, 12, 12)
    with torch.no_grad():
        expected, actual = ref(ids, attention_mask=mask).logits, ours(ids, attention_mask=mask).logits
    assert rel_err(actual, expected) < TOL
    assert calls["dense_mask"] == LAYERS and calls["varlen"] == 0


# How this transformers version describes the queries to a mask function.
STYLE = "q_length" if "q_length" in inspect.signature(mu.sdpa_mask).parameters else "cache_position"


def _mask_args(style: str, q_length: int, q_offset: int) -> dict:
    if style == "q_length":  # transformers 5
        return {"q_length": q_length, "q_offset": q_offset}
    return {"cache_position": torch.arange(q_offset, q_offset + q_length)}  # transformers 4.x


@pytest.mark.parametrize("style", ["q_length", "cache_position"])
def test_token_mask_keeps_padding_as_tokens(style):
    padding = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    # prefill: the padding mask itself; no padding: nothing
    out = cudnn_hf.token_mask(2, 6, attention_mask=padding, **_mask_args(style, 6, 0))
    assert torch.equal(out, padding)
    assert cudnn_hf.token_mask(2, 6, attention_mask=torch.ones_like(padding), **_mask_args(style, 6, 0)) is None
    # a static cache of 9 slots after 4 tokens, 2 new ones: the empty slots are left out
    out = cudnn_hf.token_mask(2, 9, attention_mask=padding, **_mask_args(style, 2, 4))
    assert torch.equal(out, padding)
    out = cudnn_hf.token_mask(2, 9, attention_mask=None, **_mask_args(style, 2, 4))
    assert out.shape == (2, 6) and bool(out.all())
    # a sliding layer's cache holds the last 5 of 6 positions
    window = mu.sliding_window_causal_mask_function(3)
    out = cudnn_hf.token_mask(2, 5, 1, window, padding, **_mask_args(style, 1, 5))
    assert torch.equal(out, padding[:, 1:])


def test_token_mask_packed_runs_become_sequence_ids():
    runs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
    composed = [mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(runs))]  # transformers 4.x
    if hasattr(mu, "packed_sequence_compatibility_function"):  # transformers 5
        composed.append(mu.packed_sequence_compatibility_function(mu.causal_mask_function, positions, runs))
    for mask_function in composed:
        out = cudnn_hf.token_mask(1, 8, 0, mask_function, None, **_mask_args(STYLE, 8, 0))
        assert torch.equal(out, runs + 1)


def test_token_mask_other_patterns_are_dense():
    """A mask function it cannot read as lengths becomes transformers' own dense mask."""
    prefix = mu.or_masks(mu.causal_mask_function, lambda b, h, q, kv: kv < 3)
    padding = torch.tensor([[0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    out = cudnn_hf.token_mask(1, 6, 0, prefix, padding, **_mask_args(STYLE, 6, 0))
    expected = mu.sdpa_mask(
        batch_size=1,
        kv_length=6,
        mask_function=prefix,
        attention_mask=padding,
        allow_is_causal_skip=False,
        **_mask_args(STYLE, 6, 0),
    )
    assert out.dim() == 4 and torch.equal(out, expected)


def test_unsupported_features_are_refused():
    layer = torch.nn.Module()
    layer.is_causal = True
    q, k, v = (randn(1, 2, 4, 8) for _ in range(3))
    cases = {
        "position_bias": dict(position_bias=torch.zeros(1, 2, 4, 4)),
    }
    for reason, kwargs in cases.items():
        with pytest.raises(UnsupportedError, match=reason):
            cudnn_hf.attention_forward(layer, q, k, v, None, **kwargs)
    fp8 = [t.to(torch.float8_e4m3fn) for t in (q, k, v)]  # float64 runs (test_transformers_fidelity.py)
    with pytest.raises(UnsupportedError, match="float8_e4m3fn"):
        cudnn_hf.attention_forward(layer, *fp8, None)
    layer.is_causal = False
    with pytest.raises(UnsupportedError, match="sliding_window"):
        cudnn_hf.attention_forward(layer, q, k, v, None, sliding_window=2)


@pytest.mark.parametrize("padding, window", [("none", 64), ("left", 64), ("right", WINDOW)])
def test_gpt_oss_sinks_match_eager_logits_and_gradients(padding, window):
    """gpt-oss's learned attention sinks (``s_aux``) through the registration, against the model's
    own eager attention (the reference implementation transformers gives it): windows shorter than
    the sequence run densely with ``window_size``, padded batches through varlen, training the
    sinks too (their backward folds them in on every cuDNN)."""
    check_against_eager(*gpt_oss_models(window), padding, ("sinks", "q_proj.weight"))


def gpt_oss_models(window: int, device: str = "cpu"):
    """A tiny gpt-oss (one sliding and one full layer, random sinks): eager and through ours."""
    from transformers import GptOssConfig

    config = GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=window,
        max_position_embeddings=256,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).to(device)
    for layer in ref.model.layers:  # random sinks: the initial zeros would hide a wrong sign or scale
        torch.nn.init.normal_(layer.self_attn.sinks, std=1.0)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(NAME)
    return ref, ours


def check_against_eager(ref, ours, padding: str, watched: tuple[str, ...]) -> None:
    """Logits on the real tokens, then one training step's gradients of the ``watched`` parameters."""
    ids, mask = batch(padding)
    real = mask.bool()
    with torch.no_grad():
        assert rel_err(ours(ids, attention_mask=mask).logits[real], ref(ids, attention_mask=mask).logits[real]) < 1e-4
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(ids.shape[0]), mask.argmax(dim=1)] = -100  # see check_gradients
    for model in (ref, ours):
        model(ids, attention_mask=mask, labels=labels).loss.backward()
    for (key, p_ref), (_, p_ours) in zip(ref.named_parameters(), ours.named_parameters()):
        if p_ref.grad is not None and any(name in key for name in watched):
            assert rel_err(p_ours.grad, p_ref.grad) < 1e-4, key


def gemma2_models(window: int, device: str = "cpu"):
    """A tiny Gemma-2 (soft-capping 5.0 so the cap bends the scores, one sliding and one full
    layer) with its eager attention, and the same weights through the registration."""
    from transformers import Gemma2Config

    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=window,
        attn_logit_softcapping=5.0,
        max_position_embeddings=256,
        query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention"],
    )
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).to(device)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(NAME)
    return ref, ours


@pytest.mark.parametrize("padding, window", [("none", 64), ("left", 64), ("right", WINDOW), ("none", WINDOW)])
def test_gemma2_softcap_matches_eager_logits_and_gradients(padding, window, calls):
    """Gemma-2's logit soft-capping through the registration, against its own eager attention:
    logits and a training step's gradients, with padding and windows shorter than the sequence.
    Padded batches go through varlen with ``softcap`` (no dense mask), unpadded ones dense."""
    ref, ours = gemma2_models(window)
    check_against_eager(ref, ours, padding, ("q_proj.weight", "k_proj.weight"))
    assert calls["dense_mask"] == 0
    assert (calls["varlen"] > 0) == (padding != "none")


@pytest.mark.parametrize("padding", ["none", "left"])
def test_gpt_oss_generation_matches_eager(padding):
    """gpt-oss generating past its window, with its sinks, padded or not: greedy tokens as eager's.
    Decode steps over padding or past the window go through varlen, whose bucketed query length
    (16 and up) keeps cuDNN off its decode-only kernels, which take no sink."""
    ref, ours = gpt_oss_models(4)
    ids, mask = batch(padding)
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), ref.generate(ids, **settings))


def test_gemma2_softcap_generation_matches_eager():
    ref, ours = gemma2_models(WINDOW)
    ids, mask = batch("left")
    settings = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(ids, **settings), ref.generate(ids, **settings))


def test_padding_only_gives_zeros():
    layer = torch.nn.Module()
    layer.is_causal = True
    q, k, v = randn(2, 4, 3, 8), randn(2, 2, 3, 8), randn(2, 2, 3, 8)
    out, _ = cudnn_hf.attention_forward(layer, q, k, v, torch.zeros(2, 3, dtype=torch.bool))
    assert out.shape == (2, 3, 4, 8) and not out.any()


def test_float32_attends_in_float32():
    # A model loaded with its default float32 weights: refused at its first forward before.
    layer = torch.nn.Module()
    layer.is_causal = True
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    mask = torch.tensor([[False, True, True, True, True]])  # left padding takes the varlen path
    out, _ = cudnn_hf.attention_forward(layer, q, k, v, None)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert out.dtype == torch.float32 and rel_err(out, expected) < 1e-5
    padded, _ = cudnn_hf.attention_forward(layer, q, k, v, mask)
    expected = F.scaled_dot_product_attention(q[:, :, 1:], k[:, :, 1:], v[:, :, 1:], is_causal=True).transpose(1, 2)
    assert padded.dtype == torch.float32 and rel_err(padded[:, 1:], expected) < 1e-5


def test_float32_under_autocast_attends_in_bf16():
    layer = torch.nn.Module()
    layer.is_causal = True
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = cudnn_hf.attention_forward(layer, q, k, v, None)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
    assert out.dtype == torch.bfloat16 and rel_err(out, expected) < TOL
