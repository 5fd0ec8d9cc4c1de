"""A paged decode step as the dispatch reads it (``dispatch.select_decode``), and why the Triton
decode kernel (or MLA's) passes one over.

``ops/`` may not import ``kernels/`` (a backend gets no help from a Triton kernel), so the
kernels' own facts come in as data: serving asks ``kernels/`` whether the decode or MLA kernel
runs on this device, page and head dims, whether the Hopper MLA kernel serves them and how many
query rows a tile holds, and hands the answers in with the step's geometry. Serving names no
kernel and ops imports none; the choice is made from values alone, so a test states it without
a GPU.

The Triton kernel's reasons come in three kinds, because ``decode_kernel="triton"`` forces the
kernel but not the impossible:

- ``cannot_run``: not on this device, page or head dims at all. Asked for by name, an error.
- ``cannot_lay_out``: this step's rows do not fit the kernel (a group by tokens past one tile,
  several MLA query tokens). Even when asked for, the step runs cuDNN's calls.
- ``prefers_not``: it runs, but was measured slower here. Only ``"auto"`` reads these.
"""

from __future__ import annotations

from dataclasses import dataclass

# The widest MLA program: 64 query heads over one latent head.
MLA_HEADS_PER_PROGRAM = 64
# An eager MLA layer on our kernels costs the host about 100 us (the Hopper kernel's four TMA
# descriptors, then the split merge: 102 us against torch's SDPA call at 24, H200 host), cuDNN's
# paged call bound to the step's tables about 40. Where cuDNN's reads (the latent once per query
# head) take the GPU less than this many bytes (about 60 us at an H200's rate), the host bounds an
# eager step: it takes cuDNN's call.
EAGER_MLA_CUDNN_BYTES = 256 * 2**20


def is_mla(num_kv_heads: int, head_dim: int, head_dim_v: int) -> bool:
    """MLA's latent cache: one K/V head, V narrower than K."""
    return num_kv_heads == 1 and head_dim_v != head_dim


@dataclass(frozen=True)
class DecodeStep:
    """One decode geometry of a ``PagedAttention``: ``batch`` rows of ``s_q`` query tokens
    (``captured``: CUDA-graph buffers; ``fp8``: FP8 caches), and the kernels' facts for it:
    ``triton_runs`` (``paged_decode.supported`` with one head dim for K and V, or
    ``mla_decode.supported``), ``hopper`` (``mla_decode_hopper.serves``, or for GQA
    ``paged_decode_hopper.serves`` with the step's rows), ``tile_rows``
    (``paged_decode.MAX_ROWS``); ``pages_per_seq``: the most pages a sequence holds."""

    device: str
    batch: int
    num_q_heads: int
    num_kv_heads: int
    s_q: int
    page_size: int
    head_dim: int
    head_dim_v: int
    captured: bool
    fp8: bool
    triton_runs: bool
    hopper: bool
    tile_rows: int
    pages_per_seq: int

    @property
    def mla(self) -> bool:
        return is_mla(self.num_kv_heads, self.head_dim, self.head_dim_v)

    @property
    def cudnn_bytes(self) -> int:
        """What cuDNN's paged decode reads at most: each query head's K and V rows."""
        tokens = self.batch * self.pages_per_seq * self.page_size
        return tokens * self.num_q_heads * (self.head_dim + self.head_dim_v) * 2

    def describe(self) -> str:
        heads = f"{self.num_q_heads}/{self.num_kv_heads} heads"
        flags = "".join((", captured" if self.captured else ", eager", ", FP8 caches" if self.fp8 else ""))
        return (
            f"paged decode of {self.batch} sequences, {heads}, {self.s_q} query tokens, page {self.page_size}, "
            f"head dims {self.head_dim}/{self.head_dim_v} on {self.device}{flags}"
        )


def cannot_run(step: DecodeStep, asked: bool) -> list[str]:
    """Why the Triton kernel cannot run this geometry here at all (``asked``: by name)."""
    if step.triton_runs:
        return []
    return [
        f"{'decode_kernel: ' if asked else ''}'triton' needs a CUDA device, Triton, a power-of-two page of "
        "16-256 tokens and one head dim for K and V, or MLA's latent (one K/V head, "
        f"powers of two for V and the rope part) (here {step.device}, page {step.page_size}, "
        f"head dims {step.head_dim}/{step.head_dim_v})"
    ]


def cannot_lay_out(step: DecodeStep) -> list[str]:
    """Why this step's rows do not fit the kernel, which runs elsewhere."""
    if step.mla:
        return [f"MLA's kernels take one query token ({step.s_q} here)"] if step.s_q > 1 else []
    group = step.num_q_heads // step.num_kv_heads
    if group * step.s_q <= step.tile_rows:
        return []
    return [f"{group} query heads per K/V head by {step.s_q} tokens exceed its tile of {step.tile_rows} rows"]


def prefers_not(step: DecodeStep) -> list[str]:
    """Where the kernel runs but was measured slower than cuDNN's calls."""
    if step.mla:
        if not step.captured and step.cudnn_bytes <= EAGER_MLA_CUDNN_BYTES:
            return [
                f"an eager MLA step whose reads on cuDNN's paged call ({step.cudnn_bytes / 2**20:.0f} MiB) take the "
                "GPU less time than our kernels' launches take the host"
            ]
        # H100, d 576/512, page 64, CUDA-graph replay: 2.5-14x cuDNN's paged decode (which reads
        # the latent once per head) from 16 heads at B16 to 128 at B64; at B1 KV 32k with 16 heads
        # the Triton kernel ran 15% behind, the Hopper kernel ahead (24.6 against 62.7 us a layer).
        if step.batch > 1 or step.num_q_heads >= MLA_HEADS_PER_PROGRAM or step.hopper:
            return []
        return [
            f"one sequence of {step.num_q_heads} heads (under {MLA_HEADS_PER_PROGRAM}) and no Hopper "
            "kernel: cuDNN's paged decode measured faster"
        ]
    # Eager, a Triton launch costs the host more than the kernel saves on the GPU (H200: 102
    # against 52 us per run); FP8 caches have no other kernel.
    if step.captured or step.fp8:
        return []
    return ["an eager step over 16-bit caches: its launch costs the host more than it saves (captured steps take it)"]
