"""``PagedAttention.warm``'s work: every plan a server's steps run, built before the first request.

Steps of the instance's largest geometry (``max_batch`` sequences of ``max_pages_per_seq``
pages) are planned and run on zero caches: decode with each query count, chunked prefill with
each packed token count (and, without CUDA graphs, each chunk bucket up to it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ValidationError
from .paged_checks import MAX_QUERY_TOKENS
from .step import bucket, canonical_device

if TYPE_CHECKING:
    from .paged_attention import PagedAttention


def check(
    attention: PagedAttention, num_pages: int, s_q: Any, prefill_tokens: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``warm``'s counts as tuples (an iterator read once), or every problem with its arguments in
    one ``ValidationError``."""
    problems = []
    if attention.max_batch is None or attention.max_pages_per_seq is None:
        problems.append("max_batch: warm() needs max_batch and max_pages_per_seq (the step geometry to plan for)")
    counts = []
    for name, given in (("s_q", s_q), ("prefill_tokens", prefill_tokens)):
        values = tuple(given) if isinstance(given, Iterable) and not isinstance(given, (str, bytes)) else None
        if values is None or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in values):
            shown = given if values is None else values
            problems.append(f"{name}: {shown!r}; expected a tuple of ints >= 1, such as (1, 4)")
        counts.append(values or ())
    s_q, prefill_tokens = counts
    if any(n > MAX_QUERY_TOKENS for n in s_q if isinstance(n, int)):
        problems.append(f"s_q: {s_q!r}; decode takes 1..{MAX_QUERY_TOKENS} query tokens")
    if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
        problems.append(f"num_pages: {num_pages!r}; must be an int >= 1")
    if problems:
        raise ValidationError(problems, context="PagedAttention.warm")
    return s_q, prefill_tokens


def run_steps(attention: PagedAttention, num_pages: int, s_q: tuple[int, ...], prefill_tokens: tuple[int, ...]) -> None:
    """Plan and run one step of each kind ``warm`` covers, on zero caches of ``num_pages`` pages."""
    assert attention.max_batch is not None and attention.max_pages_per_seq is not None
    device = attention.device or canonical_device("cuda" if torch.cuda.is_available() else "cpu")
    rows, width, page = attention.max_batch, attention.max_pages_per_seq, attention.page_size
    k_cache, v_cache = (
        torch.zeros(
            (num_pages, attention.num_kv_heads, page, dim)
            if attention.kv_layout == "NHPD"
            else (num_pages, page, attention.num_kv_heads, dim),
            dtype=attention.kv_dtype,
            device=device,
        )
        for dim in (attention.head_dim, attention.head_dim_v)
    )
    table = (torch.arange(rows * width, dtype=torch.int32, device=device) % num_pages).view(rows, width)
    lengths = torch.full((rows,), width * page, dtype=torch.int32, device=device)
    attention.plan(table, lengths)
    for tokens in s_q:
        attention.run(
            torch.zeros(rows, attention.num_q_heads, tokens, attention.head_dim, dtype=attention.dtype, device=device),
            k_cache,
            v_cache,
        )
    for tokens in prefill_tokens:
        q = torch.zeros(tokens, attention.num_q_heads, attention.head_dim, dtype=attention.dtype, device=device)
        most = min(tokens, width * page)  # without cuda_graph, each chunk bucket up to it is a plan
        buckets = {bucket(1 << b) for b in range(most.bit_length() + 1)} if not attention.cuda_graph else set()
        for chunk in sorted({min(size, most) for size in buckets} | {most}):
            q_lens = torch.zeros(rows, dtype=torch.int32)
            q_lens[: tokens // chunk] = chunk
            attention.plan(table, lengths, q_lens=q_lens)
            attention.run(q, k_cache, v_cache)
