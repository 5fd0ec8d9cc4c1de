"""Attention shapes as short strings, for the command line (``bench``, ``cache warm``).

``"b=2,h=16,hkv=4,s=4096,d=128,dtype=bf16,causal"`` — keys: b, h, hkv, s (both lengths),
sq, skv, d (both head dims), dv, dtype (fp16|bf16), layout (BHSD|BSHD), causal, bwd.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ..core.mask import default_scale
from ..errors import ValidationError

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class Shape:
    b: int = 2
    h: int = 16
    hkv: int = 0  # 0: same as h
    sq: int = 4096
    skv: int = 4096
    d: int = 128
    dv: int = 0  # 0: same as d
    dtype: str = "bf16"
    layout: str = "BSHD"
    causal: bool = False
    bwd: bool = False

    @property
    def h_kv(self) -> int:
        return self.hkv or self.h

    @property
    def d_v(self) -> int:
        return self.dv or self.d

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def label(self) -> str:
        gqa = f"/{self.h_kv}" if self.h_kv != self.h else ""
        s = f"s{self.sq}" if self.sq == self.skv else f"s{self.sq}x{self.skv}"
        d = f"d{self.d}" if self.d == self.d_v else f"d{self.d}/{self.d_v}"
        return f"b{self.b}-h{self.h}{gqa}-{s}-{d}-{self.dtype}{'-causal' if self.causal else ''}{'-bwd' if self.bwd else ''}"

    def flops(self) -> float:
        forward = 2.0 * self.b * self.h * self.sq * self.skv * (self.d + self.d_v) / (2 if self.causal else 1)
        return 2.5 * forward if self.bwd else forward

    def tensors(self, device: str = "cuda", seed: int = 0) -> dict[str, torch.Tensor]:
        """Fresh random q, k, v (and dO) in this shape's layout."""
        gen = torch.Generator().manual_seed(seed)

        def make(heads: int, s: int, d: int) -> torch.Tensor:
            if self.layout == "BSHD":
                x = torch.randn(self.b, s, heads, d, generator=gen).transpose(1, 2)
            else:
                x = torch.randn(self.b, heads, s, d, generator=gen)
            return x.to(device=device, dtype=self.torch_dtype)

        out = {
            "q": make(self.h, self.sq, self.d),
            "k": make(self.h_kv, self.skv, self.d),
            "v": make(self.h_kv, self.skv, self.d_v),
        }
        out["grad_o"] = make(self.h, self.sq, self.d_v)
        return out

    def scale(self) -> float:
        return default_scale(self.d)


FLAG_WORDS = ("", "1", "true", "yes", "on", "0", "false", "no", "off")


def parse_value(current: Any, text: str) -> Any:
    """``text`` as the type of ``current`` (a flag, an int, a ``/``-separated tuple of ints, a
    string); raises ValueError for a number that is not one. A bare key is a set flag."""
    if isinstance(current, bool):
        flag = text.strip().lower()
        if flag not in FLAG_WORDS:
            raise ValueError(f"{text!r} is not a flag value")
        return flag in ("", "1", "true", "yes", "on")
    if isinstance(current, tuple):
        return tuple(int(v) for v in text.split("/") if v.strip())
    if isinstance(current, int):
        return int(text)
    return text.strip()


def range_problems(shape: Shape, names: Mapping[str, str] | None = None) -> list[str]:
    """Where ``shape``'s numbers are out of range, one line each, naming the key (or
    ``names[key]``: the flag or key the caller gave it by). Found before any GPU is looked for:
    a bad number is a usage error, never torch's "negative dimension" at the first tensor."""
    names = names or {}
    problems = []
    for key in ("b", "h", "sq", "skv", "d"):  # an empty batch or sequence measures nothing
        if getattr(shape, key) < 1:
            problems.append(f"{names.get(key, key)}: {getattr(shape, key)}; must be >= 1")
    for key, same in (("hkv", "h"), ("dv", "d")):
        if getattr(shape, key) < 0:
            problems.append(f"{names.get(key, key)}: {getattr(shape, key)}; must be >= 1 (or 0: as {same})")
    if not problems and shape.h % shape.h_kv:
        problems.append(f"{names.get('hkv', 'hkv')}: {shape.h_kv} does not divide {names.get('h', 'h')}={shape.h}")
    return list(dict.fromkeys(problems))  # s=0 (sq and skv) said once


def parse(text: str) -> Shape:
    """``"b=2,h=16,s=4096,d=128,causal"`` -> Shape; raises ValidationError naming bad keys and
    numbers out of range."""
    known = {f.name: f.type for f in fields(Shape)}
    values: dict[str, Any] = {}
    given: dict[str, str] = {}  # sq and skv by the key that set them last
    problems = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        if name == "s":
            for side in ("sq", "skv"):
                values[side] = value
                given[side] = "s"
            continue
        given.pop(name, None)
        if name not in known:
            problems.append(f"{name}: unknown shape key; use {', '.join(['s', *known])}")
            continue
        values[name] = value if value else "1"
    shape = Shape()
    for name, value in values.items():
        current = getattr(shape, name)
        try:
            parsed = parse_value(current, str(value))
        except ValueError:
            kind = f"a flag (bare, or {name}=1/0, true/false, yes/no)" if isinstance(current, bool) else "a number"
            problems.append(f"{name}: {value!r} is not {kind}")
            continue
        shape = replace(shape, **{name: parsed})
    if shape.dtype not in DTYPES:
        problems.append(f"dtype: {shape.dtype!r}; allowed fp16, bf16")
    if shape.layout not in ("BHSD", "BSHD"):
        problems.append(f"layout: {shape.layout!r}; allowed BHSD, BSHD")
    problems += range_problems(shape, given)
    if problems:
        raise ValidationError(problems, context=f"shape {text!r}")
    return shape


STANDARD_GRID = [
    "b=16,h=16,s=1024,d=128",
    "b=4,h=16,s=4096,d=128",
    "b=4,h=16,s=4096,d=128,causal",
    "b=1,h=32,hkv=8,s=8192,d=128,causal",
    "b=4,h=16,s=4096,d=64,causal",
    "b=2,h=16,s=4096,d=256,causal",
    "b=4,h=16,s=4096,d=128,causal,bwd",
]
