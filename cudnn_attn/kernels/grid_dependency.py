"""Programmatic dependent launch (Hopper's grid dependency control) for our kernels.

A kernel launched with ``launch_pdl=True`` may start before the kernel ahead of it in the
stream has finished: its programs are placed on the SMs, and run their prologue, while the
last programs of the one before drain. ``wait`` blocks until that kernel has completed and its
writes are visible; ``release`` lets the next PDL-launched kernel start. Without PDL both are
no-ops, so a kernel compiled with them runs anywhere sm_90 code runs.

The rules our kernels keep, and why they are safe beside other kernels, ours or not:

- every read of what an earlier kernel may have written (queries, caches, partials) and every
  write comes after ``wait``, which waits for every prerequisite grid still in flight;
- ``release`` comes after ``wait``, so a kernel launched after one of ours starts only once ours
  has passed its wait (kernel starts keep stream order);
- the decode kernel reads its length and first page indices before ``wait`` only where its
  caller knows that only ``plan`` (or a layer geometry's first derivation) writes them and that
  a decode that waited has executed since (``PagedAttention``'s later layers of a step; a graph
  being captured executes nothing, so it counts apart). A kernel of another library launched
  after ours may start while ours still runs (ours releases early): the PDL contract, writes
  only after its own ``wait``, keeps that safe.
"""

from __future__ import annotations

import functools
import types
from typing import Any


def _functions(jit: Any, language: Any) -> types.SimpleNamespace:
    """``wait`` and ``release`` compiled by ``jit`` (Triton's or Gluon's) in its ``language``."""

    @jit
    def wait():
        language.inline_asm_elementwise(
            "griddepcontrol.wait; // $0", "=r", [], dtype=language.int32, is_pure=False, pack=1
        )

    @jit
    def release():
        language.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=language.int32, is_pure=False, pack=1
        )

    return types.SimpleNamespace(wait=wait, release=release)


@functools.cache
def triton_functions() -> types.SimpleNamespace:
    """``wait`` and ``release`` for Triton kernels."""
    import triton
    import triton.language as tl

    return _functions(triton.jit, tl)


@functools.cache
def gluon_functions() -> types.SimpleNamespace:
    """``wait`` and ``release`` for Gluon kernels; callers have checked that Gluon exists."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    return _functions(gluon.jit, gl)


__all__ = ["gluon_functions", "triton_functions"]
