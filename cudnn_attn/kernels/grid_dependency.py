"""Programmatic dependent launch (Hopper's grid dependency control) for our kernels.

A kernel launched with ``launch_pdl=True`` may start before the kernel ahead of it in the
stream has finished: its programs are placed on the SMs, and run their prologue, while the
last programs of the one before drain. ``wait`` blocks until that kernel has completed and its
writes are visible; ``release`` lets the next PDL-launched kernel start. Without PDL both are
no-ops, so a kernel compiled with them runs anywhere sm_90 code runs.

The rules our kernels keep, which make the chain safe:

- every read of what an earlier kernel may have written (queries, caches, partials) comes
  after ``wait``;
- ``release`` comes after ``wait``: when a kernel starts, the one before it has passed its own
  ``wait``, so everything two launches back has completed. The decode kernel reads its length
  and first page indices before ``wait`` only where its caller knows no kernel since the last
  ``plan`` wrote them but an earlier decode layer (``PagedAttention``'s later layers).
"""

from __future__ import annotations

import functools
import types


@functools.cache
def triton_functions() -> types.SimpleNamespace:
    """``wait`` and ``release`` for Triton kernels."""
    import triton
    import triton.language as tl

    @triton.jit
    def wait():
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def release():
        tl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )

    return types.SimpleNamespace(wait=wait, release=release)


@functools.cache
def gluon_functions() -> types.SimpleNamespace:
    """``wait`` and ``release`` for Gluon kernels; callers have checked that Gluon exists."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def wait():
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def release():
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )

    return types.SimpleNamespace(wait=wait, release=release)


__all__ = ["gluon_functions", "triton_functions"]
