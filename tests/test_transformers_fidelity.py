"""The transformers integration where a layer leaves the packed (varlen) door for one dense call:
Gemma-2's soft-capping over a static cache, packed batches trained with attention dropout beside
soft-capping (Gemma-2) or sinks (gpt-oss), and float64 models. Tiny random models on the CPU,
against transformers' own eager or sdpa attention with the same weights, by relative error."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from conftest import TOLERANCE, rel_err  # noqa: E402
from test_transformers_integration import (  # noqa: E402
    CONFIGS,
    NAME,
    VOCAB,
    WINDOW,
    batch,
    calls,  # noqa: F401  (the fixture)
    encoder_errors,
    gemma2_models,
    gpt_oss_models,
)
from transformers import AutoModelForCausalLM, DataCollatorWithFlattening, StaticCache  # noqa: E402

FLOAT32_TOL = 1e-4  # float32 models against eager: the same sums in another order
NO_DROP = 1e-7  # a dropout that takes the dropout path yet, for these seeds, drops nothing
LENGTHS = (5, 9, 4)  # the packed documents


def _set_dropout(model, p: float) -> None:
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = p


def _static(model, batch_size: int = 3, length: int = 20) -> StaticCache:
    return StaticCache(config=model.config, max_cache_len=length, max_batch_size=batch_size)


# --- soft-capping over a static cache ----------------------------------------------------------


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
@pytest.mark.parametrize("padding", ["none", "left"])
def test_gemma2_static_cache_is_causal_over_the_real_keys(padding, calls):  # noqa: F811
    """Prefill into a static cache longer than the prompt, then a chunk of 3 and a decoded token:
    the cache's empty slots are no keys, so each query sees the keys up to its own (it used to
    see the whole prompt, future tokens included)."""
    ref, ours = gemma2_models(WINDOW)
    ids, mask = batch(padding, length=12)
    caches = [_static(model) for model in (ref, ours)]
    with torch.no_grad():
        for start, stop in ((0, 8), (8, 11), (11, 12)):
            step = dict(attention_mask=mask[:, :stop], use_cache=True)
            expected, actual = (
                model(ids[:, start:stop], past_key_values=cache, **step).logits
                for model, cache in zip((ref, ours), caches)
            )
            real = mask[:, start:stop].bool()
            err = rel_err(actual[real], expected[real])
            assert err < FLOAT32_TOL, f"tokens {start}..{stop}: rel_err {err:.3e}"
    assert calls["dense_mask"] > 0  # the soft-capped full layer's dense path saw the static cache


def test_gemma2_static_cache_generation_matches_eager():
    ref, ours = gemma2_models(WINDOW)
    ids, mask = batch("left", length=9)
    settings = dict(
        attention_mask=mask,
        max_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        cache_implementation="static",
        output_logits=True,
        return_dict_in_generate=True,
    )
    out = [model.generate(ids, **settings) for model in (ref, ours)]
    assert torch.equal(out[1].sequences, out[0].sequences)
    assert max(rel_err(a, e) for a, e in zip(out[1].logits, out[0].logits)) < FLOAT32_TOL


# --- dropout beside soft-capping or sinks ------------------------------------------------------


def _documents(seed: int = 2) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _packed_inputs(documents: list[list[int]], route: str) -> dict:
    """One row of documents back to back, as ``DataCollatorWithFlattening`` gives it: found by
    transformers' mask code (``mask``), in the position ids with a cache (``position_ids``) or in
    the collator's ``cu_seq_lens_*`` keywords."""
    packed = DataCollatorWithFlattening(return_flash_attn_kwargs=route == "cu_seq_lens")(
        [{"input_ids": d} for d in documents]
    )
    inputs = {k: v for k, v in packed.items() if k not in ("labels", "seq_idx")}
    inputs["use_cache"] = route != "mask"
    return inputs


def _models(name: str):
    return gemma2_models(WINDOW) if name == "gemma2" else gpt_oss_models(WINDOW)


@pytest.mark.parametrize("route", ["mask", "position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_packed_documents_stay_apart_with_dropout(name, route):
    """Training on packed documents with attention dropout: each document attends within
    itself, as transformers' FlashAttention path keeps them. Without drops the logits are the
    documents' run alone; with dropout 0.3 and one seed, changing the first document changes
    none of the others' logits."""
    ref, ours = _models(name)
    documents = _documents()
    with torch.no_grad():
        alone = torch.cat([ref(torch.tensor([d])).logits for d in documents], dim=1)
    ours.train()
    _set_dropout(ours, NO_DROP)
    torch.manual_seed(0)
    with torch.no_grad():
        err = rel_err(ours(**_packed_inputs(documents, route)).logits, alone)
    assert err < FLOAT32_TOL, f"without drops: rel_err {err:.3e} against the documents alone"

    _set_dropout(ours, 0.3)
    other = [_documents(seed=7)[0], *documents[1:]]
    runs = []
    for docs in (documents, other):
        torch.manual_seed(0)
        with torch.no_grad():
            runs.append(ours(**_packed_inputs(docs, route)).logits)
    first = LENGTHS[0]
    assert rel_err(runs[1][:, first:], runs[0][:, first:]) < 1e-6, "a document saw the one before it"
    assert not rel_err(runs[0], alone) < 0.05, "dropout 0.3 left the logits as they were"


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_gpt_oss_trains_with_dropout(padding):
    """gpt-oss's sinks beside attention dropout (refused before): without drops, the logits and
    a training step's gradients are eager's; with dropout 0.3 the padding stays out (changing the
    padding tokens changes no real token's logits under one seed) and the sinks get gradients."""
    ref, ours = gpt_oss_models(WINDOW)
    ids, mask = batch(padding)
    real = mask.bool()
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(ids.shape[0]), mask.argmax(dim=1)] = -100  # see check_gradients
    ours.train()
    _set_dropout(ours, NO_DROP)
    torch.manual_seed(0)
    logits = []
    for model in (ref, ours):
        out = model(ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        logits.append(out.logits.detach())
    assert rel_err(logits[1][real], logits[0][real]) < FLOAT32_TOL
    for (key, p_ref), (_, p_ours) in zip(ref.named_parameters(), ours.named_parameters()):
        if any(watched in key for watched in ("sinks", "q_proj.weight", "k_proj.weight")):
            err = rel_err(p_ours.grad, p_ref.grad)
            assert err < FLOAT32_TOL, f"{key}: gradient rel_err {err:.3e}"

    _set_dropout(ours, 0.3)
    ours.zero_grad()
    other = ids.masked_fill(~real, 3)  # other tokens at the padding
    runs = []
    for tokens in (ids, other):
        torch.manual_seed(0)
        runs.append(ours(tokens, attention_mask=mask).logits)
    assert rel_err(runs[1][real], runs[0][real]) < 1e-6, "the padding reached a real token"
    assert not rel_err(runs[0][real], logits[0][real]) < 0.05, "dropout 0.3 left the logits as they were"
    runs[0][real].square().mean().backward()
    sinks = [layer.self_attn.sinks.grad for layer in ours.model.layers]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in sinks)


# --- float64 ------------------------------------------------------------------------------------


@pytest.mark.parametrize("padding", ["none", "left", "right"])
def test_float64_model_matches_sdpa(padding):
    """A float64 model (gradcheck, numerical debugging) runs as transformers' sdpa runs it (it
    was refused): logits, a training step's gradients and greedy tokens over a static cache."""
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(CONFIGS["llama"](), attn_implementation="sdpa", dtype=torch.float64)
    ours = copy.deepcopy(ref)
    ours.set_attn_implementation(NAME)
    ids, mask = batch(padding)
    real = mask.bool()
    labels = ids.masked_fill(mask == 0, -100)
    labels[torch.arange(ids.shape[0]), mask.argmax(dim=1)] = -100  # see check_gradients
    outs = [model(ids, attention_mask=mask, labels=labels) for model in (ref, ours)]
    assert outs[1].logits.dtype == torch.float64
    assert rel_err(outs[1].logits[real], outs[0].logits[real]) < TOLERANCE[torch.float64]
    for out in outs:
        out.loss.backward()
    for (key, p_ref), (_, p_ours) in zip(ref.named_parameters(), ours.named_parameters()):
        if p_ref.grad is not None and not key.endswith("k_proj.bias"):
            err = rel_err(p_ours.grad, p_ref.grad)
            assert err < TOLERANCE[torch.float64], f"{key}: gradient rel_err {err:.3e}"
    settings = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    settings["cache_implementation"] = "static"
    with torch.no_grad():
        assert torch.equal(ours.generate(ids, **settings), ref.generate(ids, **settings))


def test_float64_encoder_and_cross_attention_match_sdpa():
    """float64 masks without causality: a padded encoder (BERT) and a decoder's cross-attention
    to it (BART), whose queries are no keys: each sees every real key of its row."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("BERT and BART build their masks with transformers' mask registry from transformers 5 on")
    for name, err in encoder_errors(torch.float64, 2).items():
        assert err < TOLERANCE[torch.float64], f"{name}: rel_err {err:.3e}"
