"""A server's paged attention geometry as a short string, for ``cudnn-attn cache warm``.

``"paged,h=32,hkv=8,d=128,page=64,batch=64,pages=512,cache=40000,sq=1/4,prefill=4096,graph"``
-- keys: h (query heads), hkv, d, page (page size), batch (``max_batch``), pages
(``max_pages_per_seq``), cache (pages in each layer's K and V cache), sq (decode query tokens,
``/``-separated), prefill (packed token counts of chunked-prefill steps, ``/``-separated),
dtype (fp16|bf16), layout (NHPD|NPHD), graph (the server captures steps: ``cuda_graph=True``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import ValidationError
from ..serving.paged_attention import LAYOUTS, PagedAttention
from ..serving.paged_checks import MAX_QUERY_TOKENS
from .shapes import DTYPES, parse_value

MARKER = "paged"


@dataclass(frozen=True)
class ServingShape:
    h: int = 32
    hkv: int = 8
    d: int = 128
    page: int = 64
    batch: int = 64
    pages: int = 512
    cache: int = 0  # 0: batch * pages
    sq: tuple[int, ...] = (1,)
    prefill: tuple[int, ...] = ()
    dtype: str = "bf16"
    layout: str = "NHPD"
    graph: bool = False

    def label(self) -> str:
        steps = [f"sq{'/'.join(map(str, self.sq))}"] + (
            [f"prefill{'/'.join(map(str, self.prefill))}"] * bool(self.prefill)
        )
        return (
            f"paged-h{self.h}/{self.hkv}-d{self.d}-page{self.page}-b{self.batch}x{self.pages}-"
            f"cache{self.num_pages}-{self.dtype}{'' if self.layout == 'NHPD' else '-' + self.layout}-"
            f"{'-'.join(steps)}{'-graph' if self.graph else ''}"
        )

    @property
    def num_pages(self) -> int:
        return self.cache or self.batch * self.pages

    def attention(self, device: Any = "cuda", autotune: bool = False) -> PagedAttention:
        """The ``PagedAttention`` the server makes (its plans are what ``warm`` builds)."""
        return PagedAttention(
            self.h,
            self.hkv,
            self.d,
            self.page,
            dtype=DTYPES[self.dtype],
            kv_layout=self.layout,
            max_batch=self.batch,
            max_pages_per_seq=self.pages,
            cuda_graph=self.graph,
            device=device,
            autotune=autotune,
        )

    def warm(self, device: Any = "cuda", autotune: bool = True) -> list[str]:
        """Build (tuned) or load every plan of this server's steps; returns each plan's source."""
        return self.attention(device, autotune).warm(self.num_pages, s_q=self.sq, prefill_tokens=self.prefill)


def is_serving(text: str) -> bool:
    return text.split(",", 1)[0].strip().lower() == MARKER


def parse(text: str) -> ServingShape:
    """``"paged,h=32,hkv=8,..."`` -> ServingShape; raises ValidationError naming bad keys."""
    known = {f.name for f in fields(ServingShape)}
    shape, problems = ServingShape(), []
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts or parts[0].lower() != MARKER:
        problems.append(f"shape: a serving shape starts with '{MARKER},'")
    for part in parts[1:]:
        name, _, value = part.partition("=")
        name = name.strip().lower()
        if name not in known:
            problems.append(f"{name}: unknown serving-shape key; use {', '.join(sorted(known))}")
            continue
        current = getattr(shape, name)
        try:
            parsed = parse_value(current, value)
        except ValueError:
            if isinstance(current, bool):
                problems.append(f"{name}: {value!r}; a flag is bare ({name}) or {name}=1/0, true/false, yes/no")
            else:
                problems.append(f"{name}: {value!r} is not a number (lists are '/'-separated: sq=1/4)")
            continue
        shape = replace(shape, **{name: parsed})
    if shape.dtype not in DTYPES:
        problems.append(f"dtype: {shape.dtype!r}; allowed fp16, bf16")
    if shape.layout not in LAYOUTS:
        problems.append(f"layout: {shape.layout!r}; allowed {', '.join(LAYOUTS)}")
    for name in ("h", "hkv", "d", "page", "batch", "pages", "cache"):
        if getattr(shape, name) < (0 if name == "cache" else 1):
            problems.append(f"{name}: {getattr(shape, name)}; must be >= 1")
    if not problems and shape.h % shape.hkv:
        problems.append(f"hkv: {shape.hkv} does not divide h={shape.h}")
    if not shape.sq or any(not 1 <= n <= MAX_QUERY_TOKENS for n in shape.sq):
        problems.append(
            f"sq: {'/'.join(map(str, shape.sq)) or 'none'}; decode takes 1..{MAX_QUERY_TOKENS} query tokens"
        )
    if any(n < 1 for n in shape.prefill):
        problems.append(f"prefill: {'/'.join(map(str, shape.prefill))}; token counts must be >= 1")
    if problems:
        raise ValidationError(problems, context=f"serving shape {text!r}")
    return shape


__all__ = ["ServingShape", "is_serving", "parse"]
