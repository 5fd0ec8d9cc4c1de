"""Derived integer inputs (clamped lengths and page tables, THD offsets) are computed once per
content version of the input tensor, and never reused stale."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
from cases import paged_cache
from conftest import randn

import cudnn_attn
from cudnn_attn.core import bounds
from cudnn_attn.core import derived as derived_inputs
from cudnn_attn.ops.cudnn.lowering import Lowered
from cudnn_attn.ops.cudnn.plan import CudnnPlan
from cudnn_attn.ops.reference.backend import ReferencePlan

calls: list[int] = []


def counted_double(t: torch.Tensor, factor: int = 2) -> torch.Tensor:
    """A derivation that records each time it really runs (not the tensor: that would keep it)."""
    calls.append(factor)
    return t * factor


@pytest.fixture(autouse=True)
def fresh_cache():
    derived_inputs.set_enabled(True)
    derived_inputs.clear()
    calls.clear()
    yield
    derived_inputs.set_enabled(None)
    derived_inputs.clear()
    calls.clear()


# ---- the cache itself ----------------------------------------------------------------------


def test_same_tensor_is_derived_once():
    t = torch.tensor([1, 2, 3], dtype=torch.int32)
    first = derived_inputs.derived(t, counted_double)
    second = derived_inputs.derived(t, counted_double)
    assert second is first and len(calls) == 1
    assert torch.equal(first, t * 2)


def test_parameters_are_part_of_the_key():
    t = torch.tensor([1, 2, 3], dtype=torch.int32)
    two, three = derived_inputs.derived(t, counted_double, 2), derived_inputs.derived(t, counted_double, 3)
    assert torch.equal(two, t * 2) and torch.equal(three, t * 3) and len(calls) == 2
    assert derived_inputs.derived(t, counted_double, 2) is two and len(calls) == 2


def test_in_place_update_is_seen():
    t = torch.tensor([1, 2, 3], dtype=torch.int32)
    derived_inputs.derived(t, counted_double)
    t += 1  # the decode step's lengths += 1
    assert torch.equal(derived_inputs.derived(t, counted_double), torch.tensor([4, 6, 8], dtype=torch.int32))
    t[0] = 10
    assert torch.equal(derived_inputs.derived(t, counted_double), torch.tensor([20, 6, 8], dtype=torch.int32))
    t.copy_(torch.tensor([0, 0, 1]))
    assert torch.equal(derived_inputs.derived(t, counted_double), torch.tensor([0, 0, 2], dtype=torch.int32))
    assert len(calls) == 4


def test_views_share_the_version_counter():
    """torch's premise the cache rests on: a write through any view bumps every view's version."""
    base = torch.arange(8, dtype=torch.int32)
    view = base.view(2, 4)[1]
    before = (base._version, view._version)
    view.add_(1)
    assert base._version > before[0] and view._version > before[1]
    base[0] = 5
    assert view._version == base._version


def test_write_through_another_view_is_seen():
    table = torch.arange(12, dtype=torch.int32).view(3, 4)
    row = table[1]
    derived_inputs.derived(table, counted_double)
    derived_inputs.derived(row, counted_double)
    row[2] = 100  # through the view: the table's derived value must change
    assert derived_inputs.derived(table, counted_double)[1, 2] == 200
    table[1, 3] = 7  # through the base: the view's derived value must change
    assert derived_inputs.derived(row, counted_double)[3] == 14
    flat = table.view(-1)
    flat[0] = -1  # through a view made after the derivation
    assert derived_inputs.derived(table, counted_double)[0, 0] == -2
    assert len(calls) == 5


def test_new_tensors_are_never_served_stale():
    """Fresh tensors each step (ids and memory recycled): the result always fits the values."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        t = torch.randint(-5, 50, (4,), generator=gen, dtype=torch.int32)
        assert torch.equal(derived_inputs.derived(t, counted_double), t * 2)
        del t


def test_a_dead_tensors_id_never_matches():
    t = torch.tensor([1, 2], dtype=torch.int32)
    derived_inputs.derived(t, counted_double)
    ref = weakref.ref(t)
    key_id = id(t)
    del t
    gc.collect()
    assert ref() is None
    # Make tensors until one takes the dead tensor's id (CPython reuses addresses), or give up.
    keep = []
    for i in range(10_000):
        u = torch.tensor([i, i], dtype=torch.int32)
        if id(u) == key_id:
            assert torch.equal(derived_inputs.derived(u, counted_double), u * 2)
            break
        keep.append(u)


def test_no_strong_reference_to_the_input():
    t = torch.tensor([1, 2, 3], dtype=torch.int32)
    result = derived_inputs.derived(t, counted_double)
    ref = weakref.ref(t)
    del t
    gc.collect()
    assert ref() is None, "the cache keeps the input alive"
    assert torch.equal(result, torch.tensor([2, 4, 6], dtype=torch.int32))


def test_the_cache_is_bounded_and_drops_the_oldest():
    inputs = [torch.tensor([i], dtype=torch.int32) for i in range(derived_inputs.MAX_ENTRIES + 10)]
    results = [derived_inputs.derived(t, counted_double) for t in inputs]
    assert derived_inputs.size() == derived_inputs.MAX_ENTRIES
    calls.clear()
    assert derived_inputs.derived(inputs[-1], counted_double) is results[-1] and not calls  # newest kept
    fresh = derived_inputs.derived(inputs[0], counted_double)  # oldest dropped: derived again
    assert fresh is not results[0] and torch.equal(fresh, results[0]) and len(calls) == 1
    assert derived_inputs.size() == derived_inputs.MAX_ENTRIES


def test_a_new_version_replaces_its_entry():
    t = torch.tensor([1], dtype=torch.int32)
    for _ in range(derived_inputs.MAX_ENTRIES * 2):
        derived_inputs.derived(t, counted_double)
        t += 1
    assert derived_inputs.size() == 1


def test_shape_and_storage_changes_are_seen():
    t = torch.arange(6, dtype=torch.int32)
    derived_inputs.derived(t, counted_double)
    t.data = torch.arange(6, dtype=torch.int32).view(2, 3) + 1  # no version bump: new storage
    assert torch.equal(derived_inputs.derived(t, counted_double), (torch.arange(6).view(2, 3) + 1) * 2)
    t.data = t.view(3, 2)  # same storage and version, another shape
    assert derived_inputs.derived(t, counted_double).shape == (3, 2)
    assert len(calls) == 3


def test_inference_tensors_are_derived_every_time():
    with torch.inference_mode():
        t = torch.tensor([1, 2], dtype=torch.int32)  # no version counter: writes would be invisible
        first = derived_inputs.derived(t, counted_double)
        t.add_(1)
        second = derived_inputs.derived(t, counted_double)
    assert torch.equal(first, torch.tensor([2, 4], dtype=torch.int32))
    assert torch.equal(second, torch.tensor([4, 6], dtype=torch.int32))
    assert len(calls) == 2 and derived_inputs.size() == 0


def test_inference_mode_reuses_and_chains():
    """A normal tensor used under inference mode (serving): still reused, and what is derived is
    a normal tensor, so a derivation of it (THD offsets from clamped lengths) is reused too."""
    t = torch.tensor([1, 2], dtype=torch.int32)
    with torch.inference_mode():
        first = derived_inputs.derived(t, counted_double)
        assert not first.is_inference()
        chained = derived_inputs.derived(first, counted_double, 3)
        assert derived_inputs.derived(t, counted_double) is first
        assert derived_inputs.derived(first, counted_double, 3) is chained
        t.add_(1)  # an in-place write under inference mode still bumps a normal tensor's version
        assert torch.equal(derived_inputs.derived(t, counted_double), torch.tensor([4, 6], dtype=torch.int32))
    assert len(calls) == 3


def test_turned_off_derives_every_time():
    derived_inputs.set_enabled(False)
    t = torch.tensor([1], dtype=torch.int32)
    a, b = derived_inputs.derived(t, counted_double), derived_inputs.derived(t, counted_double)
    assert a is not b and len(calls) == 2 and derived_inputs.size() == 0


def test_env_turns_it_off(monkeypatch):
    monkeypatch.setenv(derived_inputs.ENV, "0")
    derived_inputs.set_enabled(None)
    assert not derived_inputs.enabled()
    monkeypatch.setenv(derived_inputs.ENV, "1")
    derived_inputs.set_enabled(None)
    assert derived_inputs.enabled()


# ---- CUDA streams and graph capture, stood in for on CPU ---------------------------------


class FakeCuda:
    """Makes CPU tensors look like CUDA tensors to the cache: a current stream, a capture flag."""

    def __init__(self, monkeypatch):
        self.stream = 111
        self.capturing = False
        self.capture_checks = 0
        monkeypatch.setattr(derived_inputs, "_cuda_index", lambda t: 0)
        monkeypatch.setattr(derived_inputs, "_current_stream", lambda device: self.stream)
        monkeypatch.setattr(derived_inputs, "_capturing", self._capturing)

    def _capturing(self, device: int) -> bool:
        self.capture_checks += 1
        return self.capturing


def test_streams_do_not_share_results(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    t = torch.tensor([1, 2], dtype=torch.int32)
    on_a = derived_inputs.derived(t, counted_double)
    cuda.stream = 222
    on_b = derived_inputs.derived(t, counted_double)
    assert on_b is not on_a and len(calls) == 2
    cuda.stream = 111
    assert derived_inputs.derived(t, counted_double) is on_a and len(calls) == 2


def test_capture_neither_reuses_nor_stores(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    t = torch.tensor([1, 2], dtype=torch.int32)
    eager = derived_inputs.derived(t, counted_double)
    cuda.capturing = True
    captured = [derived_inputs.derived(t, counted_double) for _ in range(2)]
    assert all(c is not eager for c in captured) and captured[0] is not captured[1]
    assert len(calls) == 3  # derived afresh inside the capture, every call
    u = torch.tensor([5], dtype=torch.int32)
    in_capture = derived_inputs.derived(u, counted_double)
    cuda.capturing = False
    assert derived_inputs.derived(u, counted_double) is not in_capture  # nothing stored while capturing
    assert derived_inputs.derived(t, counted_double) is eager  # and the eager result is still good
    assert cuda.capture_checks == 6  # one check per call on a CUDA tensor, hit or miss


def test_cpu_tensors_never_ask_about_capture(monkeypatch):
    checks = []
    monkeypatch.setattr(derived_inputs, "_capturing", lambda device: checks.append(device) or False)
    t = torch.tensor([1], dtype=torch.int32)
    derived_inputs.derived(t, counted_double)
    derived_inputs.derived(t, counted_double)
    assert checks == []


# ---- bounds.clamped: the same values as before, derived once --------------------------------


def clamped_unmemoised(p, inputs, limits) -> dict[str, Any]:
    """``bounds.clamped`` as it was before memoisation: the values it must keep producing."""
    safe: dict[str, Any] = dict(inputs)
    for role, high in limits.items():
        value = safe.get(role)
        if isinstance(value, torch.Tensor):
            safe[role] = value.clamp(0, high)
    if p.is_thd:
        for role, tokens in (("seq_len_q", p.q.shape[0]), ("seq_len_kv", p.k.shape[0])):
            lengths = safe[role].reshape(-1).to(torch.int64)
            ends = torch.cumsum(lengths, 0).clamp(max=tokens)
            starts = torch.cat([ends.new_zeros(1), ends[:-1]])
            safe[role] = (ends - starts).to(torch.int32).view(safe[role].shape)
    return safe


def paged_graph(b=3, s_q=1, pages=12, page=4, table_cols=5, same_table=False):
    q = randn(b, 4, s_q, 16)
    cache = randn(pages, page, 2, 16)
    table_k = torch.zeros(b, table_cols, dtype=torch.int32)
    table_v = table_k if same_table else table_k.clone()
    seq_kv = torch.full((b,), page, dtype=torch.int32)
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa_with_paged_cache(
            q, cache, cache, table_k, page_table_v=table_v, seq_len_kv=seq_kv, kv_cache_layout="NPHD"
        )
    return g, dict(q=q, k=cache, v=cache, page_table_k=table_k, page_table_v=table_v, seq_len_kv=seq_kv)


def thd_graph(lengths_q=(3, 5, 1), lengths_kv=(4, 2, 6), s=8, spare=2):
    tokens_q, tokens_kv = sum(lengths_q) + spare, sum(lengths_kv) + spare
    q, k, v = randn(tokens_q, 4, 16), randn(tokens_kv, 2, 16), randn(tokens_kv, 2, 16)
    seq_q, seq_kv = torch.tensor(lengths_q, dtype=torch.int32), torch.tensor(lengths_kv, dtype=torch.int32)
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa(q, k, v, seq_len_q=seq_q, seq_len_kv=seq_kv, max_seq_len_q=s, max_seq_len_kv=s)
    return g, dict(q=q, k=k, v=v, seq_len_q=seq_q, seq_len_kv=seq_kv)


def assert_same_values(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for role, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[role].dtype == value.dtype and got[role].shape == value.shape, role
            assert torch.equal(got[role], value), role
        else:
            assert got[role] == value, role


@pytest.mark.parametrize("seed", range(20))
def test_clamped_matches_the_unmemoised_values_paged(seed):
    gen = torch.Generator().manual_seed(seed)
    g, inputs = paged_graph()
    p = g.problems[0]
    limits = bounds.upper_bounds(p)
    for step in range(3):
        inputs["page_table_k"].copy_(torch.randint(-20, 40, inputs["page_table_k"].shape, generator=gen))
        inputs["page_table_v"][step % 3, :] = torch.randint(-20, 40, (5,), generator=gen, dtype=torch.int32)
        inputs["seq_len_kv"].copy_(torch.randint(-30, 60, (3,), generator=gen))
        expected = clamped_unmemoised(p, inputs, limits)
        assert_same_values(bounds.clamped(p, inputs, limits), expected)
        assert_same_values(bounds.clamped(p, inputs, limits), expected)  # the reused results


@pytest.mark.parametrize("seed", range(20))
def test_clamped_matches_the_unmemoised_values_thd(seed):
    gen = torch.Generator().manual_seed(seed)
    g, inputs = thd_graph()
    p = g.problems[0]
    limits = bounds.upper_bounds(p)
    for _ in range(3):
        inputs["seq_len_q"].copy_(torch.randint(-10, 20, (3,), generator=gen))
        inputs["seq_len_kv"].copy_(torch.randint(-10, 20, (3,), generator=gen))
        expected = clamped_unmemoised(p, inputs, limits)
        assert_same_values(bounds.clamped(p, inputs, limits), expected)
        assert_same_values(bounds.clamped(p, inputs, limits), expected)


def test_clamped_is_derived_once_per_content():
    g, inputs = paged_graph(same_table=True)
    p = g.problems[0]
    limits = bounds.upper_bounds(p)
    first = bounds.clamped(p, inputs, limits)
    assert first["page_table_k"] is first["page_table_v"]  # one table, one bound: one clamp
    again = bounds.clamped(p, inputs, limits)  # the next layer
    assert all(again[r] is first[r] for r in ("page_table_k", "page_table_v", "seq_len_kv"))
    assert again["q"] is inputs["q"]
    inputs["seq_len_kv"] += 1  # the next decode step
    step = bounds.clamped(p, inputs, limits)
    assert step["seq_len_kv"] is not first["seq_len_kv"] and step["page_table_k"] is first["page_table_k"]
    assert torch.equal(step["seq_len_kv"], (inputs["seq_len_kv"]).clamp(0, p.s_kv))


def test_clamped_thd_is_derived_once_per_content():
    g, inputs = thd_graph()
    p = g.problems[0]
    limits = bounds.upper_bounds(p)
    first = bounds.clamped(p, inputs, limits)
    again = bounds.clamped(p, inputs, limits)
    assert again["seq_len_q"] is first["seq_len_q"] and again["seq_len_kv"] is first["seq_len_kv"]
    inputs["seq_len_q"][0] = 100  # past the packed tensor: cut
    step = bounds.clamped(p, inputs, limits)
    assert_same_values(step, clamped_unmemoised(p, inputs, limits))
    assert step["seq_len_kv"] is first["seq_len_kv"]


# ---- CudnnPlan's THD offsets (no GPU needed: only the offsets are bound) ---------------------


def ragged_offsets_unmemoised(ragged, inputs) -> dict[int, torch.Tensor]:
    """``CudnnPlan._bind_ragged_offsets`` as it was before memoisation."""
    pack: dict[int, torch.Tensor] = {}
    starts: dict[str, torch.Tensor] = {}
    for uid, (lengths_role, token_stride) in ragged.items():
        start = starts.get(lengths_role)
        if start is None:
            lengths = inputs[lengths_role]
            start = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
            torch.cumsum(lengths.reshape(-1), 0, out=start[1:])
            starts[lengths_role] = start
        pack[uid] = (start * token_stride).view(-1, 1, 1, 1)
    return pack


def offsets_plan(ragged) -> CudnnPlan:
    plan = CudnnPlan.__new__(CudnnPlan)
    plan.lowered = Lowered(graph=None, ragged=ragged)
    return plan


def test_ragged_offsets_match_and_are_derived_once():
    ragged = {1: ("seq_len_q", 64), 2: ("seq_len_kv", 32), 3: ("seq_len_kv", 32 * 3), 4: ("seq_len_q", 64)}
    plan, other_plan = offsets_plan(ragged), offsets_plan(dict(ragged))
    gen = torch.Generator().manual_seed(3)
    inputs = {
        "seq_len_q": torch.randint(0, 9, (4, 1, 1, 1), generator=gen, dtype=torch.int32),
        "seq_len_kv": torch.randint(0, 9, (4, 1, 1, 1), generator=gen, dtype=torch.int32),
    }
    first: dict[int, Any] = {}
    plan._bind_ragged_offsets(inputs, first)
    expected = ragged_offsets_unmemoised(ragged, inputs)
    assert_same_values(first, expected)
    again: dict[int, Any] = {}
    other_plan._bind_ragged_offsets(inputs, again)  # another layer's plan: shared
    assert all(again[uid] is first[uid] for uid in ragged)
    assert first[1] is first[4]  # same lengths, same stride
    inputs["seq_len_kv"][2] = 8
    step: dict[int, Any] = {}
    plan._bind_ragged_offsets(inputs, step)
    assert_same_values(step, ragged_offsets_unmemoised(ragged, inputs))
    assert step[1] is first[1] and step[2] is not first[2]


def test_ragged_offsets_from_clamped_lengths_chain_under_inference_mode():
    g, inputs = thd_graph()
    p = g.problems[0]
    limits = bounds.upper_bounds(p)
    plan = offsets_plan({1: ("seq_len_q", 64), 2: ("seq_len_kv", 32)})
    with torch.inference_mode():
        packs = []
        for _ in range(2):  # two layers: the clamped lengths and their offsets both reused
            safe = bounds.clamped(p, inputs, limits)
            pack: dict[int, Any] = {}
            plan._bind_ragged_offsets(safe, pack)
            packs.append(pack)
    assert all(packs[1][uid] is packs[0][uid] for uid in (1, 2))
    assert_same_values(packs[0], ragged_offsets_unmemoised(plan.lowered.ragged, safe))


# ---- the reference backend, taking the GPU path (clamped, not checked on the host) ----------


@pytest.fixture
def reference_clamps(monkeypatch):
    """The reference plan clamps on every device, as it does for GPU tensors."""
    monkeypatch.setattr(
        ReferencePlan,
        "_checked",
        lambda self, inputs, outputs: bounds.clamped(self.problem, inputs, self._bounds, outputs),
    )


def run_twice_and_uncached(g, args) -> list[torch.Tensor]:
    runs = [g(*args).clone(), g(*args).clone()]
    derived_inputs.set_enabled(False)
    runs.append(g(*args).clone())
    derived_inputs.set_enabled(True)
    return runs


def test_reference_paged_with_clamping_matches(reference_clamps):
    gen = torch.Generator().manual_seed(5)
    b, h, h_kv, s_kv, d, page = 2, 4, 2, 20, 32, 8
    q = randn(b, h, 1, d, generator=gen)
    k_dense, v_dense = randn(b, h_kv, s_kv, d, generator=gen), randn(b, h_kv, s_kv, d, generator=gen)
    k_cache, table_k = paged_cache(k_dense, page, "NPHD", seed=6)
    v_cache, table_v = paged_cache(v_dense, page, "NPHD", seed=7)
    seq_kv = torch.tensor([20, 13], dtype=torch.int32)
    with cudnn_attn.Graph(backend="reference") as g:
        g.sdpa_with_paged_cache(
            q, k_cache, v_cache, table_k, page_table_v=table_v, seq_len_kv=seq_kv, kv_cache_layout="NPHD"
        )
    args = (q, k_cache, v_cache, table_k, seq_kv, table_v)
    in_range = run_twice_and_uncached(g, args)
    assert torch.equal(in_range[0], in_range[1]) and torch.equal(in_range[0], in_range[2])
    seq_kv -= 7  # the next step: new lengths, one page table entry out of range
    table_k[1, 0] = 1000
    changed = run_twice_and_uncached(g, args)
    assert torch.equal(changed[0], changed[1]) and torch.equal(changed[0], changed[2])
    assert not torch.equal(changed[0], in_range[0])


def test_reference_thd_with_clamping_matches(reference_clamps):
    g, inputs = thd_graph()
    args = (inputs["q"], inputs["k"], inputs["v"], inputs["seq_len_q"], inputs["seq_len_kv"])
    in_range = run_twice_and_uncached(g, args)
    assert torch.equal(in_range[0], in_range[1]) and torch.equal(in_range[0], in_range[2])
    inputs["seq_len_q"][1] = 50  # out of range: clamped to s_q, then cut at the packed end
    inputs["seq_len_kv"][0] = -3
    changed = run_twice_and_uncached(g, args)
    assert torch.equal(changed[0], changed[1]) and torch.equal(changed[0], changed[2])
    assert not torch.equal(changed[0], in_range[0])
