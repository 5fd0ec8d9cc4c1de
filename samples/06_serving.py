"""Serving a decoder language model from a paged K/V cache with continuous batching: requests
join when a slot is free and leave when done. Each new prompt is prefilled packed with the
others joining with it (``cudnn_attn.varlen_sdpa``, causal) and its K/V written into pages
handed out from a free list; every decode step plans ``cudnn_attn.PagedAttention`` once and
runs it in every layer. On a GPU the decode step (all layers) is captured once in a CUDA graph
and replayed after each plan.

    python samples/06_serving.py

Runs on a GPU (cuDNN) or, smaller, on the CPU (the reference backend, eagerly). The model's
weights are random: the checks compare the serving paths with the same model run without a
cache, not the text it writes.
"""

from __future__ import annotations

import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

import cudnn_attn

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
gpu = device == "cuda"
torch.manual_seed(0)
VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = (8192, 1024, 4, 16, 4) if gpu else (512, 256, 2, 8, 2)
HEAD_DIM = HIDDEN // HEADS
PAGE = 64 if gpu else 16  # tokens per page
REQUESTS, MAX_BATCH = (128, 32) if gpu else (6, 4)
PROMPT_LENGTHS, NEW_TOKENS = ((16, 1000), (16, 200)) if gpu else ((5, 40), (4, 12))
MAX_PAGES = math.ceil((PROMPT_LENGTHS[1] + NEW_TOKENS[1] - 1) / PAGE)  # a sequence's pages, at most
# Page 0 is scratch: the padding rows of a decode step read and write only there. The pool holds
# the rest: enough for the longest requests in most slots, so a request may wait for pages too.
NUM_PAGES = 1 + MAX_BATCH * MAX_PAGES * 3 // 4
CHECK_EVERY, CHECK_ROWS = (150, 8) if gpu else (1, MAX_BATCH)  # decode steps checked against the dense path


# ---- the model: one definition, three ways to attend ---------------------------------------------


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of ``x`` ``[T, heads, D]`` at the positions ``cos``/``sin`` were taken at."""
    x1, x2 = x.float().chunk(2, -1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).to(x.dtype)


class Block(torch.nn.Module):
    """Pre-norm decoder block; the attention itself is the caller's (``attend``)."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.RMSNorm(HIDDEN), torch.nn.RMSNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=False)
        self.out = torch.nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(4 * HIDDEN, HIDDEN)
        )

    def forward(self, x, cos, sin, attend):
        q, k, v = self.qkv(self.norm1(x)).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k, v))  # [T, heads, head_dim]
        x = x + self.out(attend(rotate(q, cos, sin), rotate(k, cos, sin), v).flatten(-2))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        # Small embeddings (std 0.1, not 1), so that attention decides much of each logit: with
        # the token's own embedding dominating, a wrong read of the cache would hardly show.
        torch.nn.init.normal_(self.embed.weight, std=0.1)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = torch.nn.RMSNorm(HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        # Rotary tables in float32 for every position a sequence reaches (not parameters: they stay float32).
        angles = torch.arange(MAX_PAGES * PAGE)[:, None] * 10000.0 ** (-torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)
        self.cos, self.sin = angles.cos().to(device), angles.sin().to(device)

    def forward(self, tokens, positions, attend, last=None):
        """Logits (float32) of ``tokens`` ``[T]`` at ``positions`` ``[T]`` (of the rows ``last``
        only, when given). ``attend(layer, q, k, v)`` takes ``[T, heads, head_dim]`` and returns
        the attention output ``[T, HEADS, head_dim]``."""
        x = self.embed(tokens)
        cos, sin = self.cos[positions], self.sin[positions]
        for layer, block in enumerate(self.blocks):
            x = block(x, cos, sin, lambda q, k, v, layer=layer: attend(layer, q, k, v))
        if last is not None:
            x = x[last]
        return self.head(self.norm(x)).float()


def dense_logits(model: TinyLM, tokens: list[int]) -> torch.Tensor:
    """The same model without a cache: one sequence, whole, through ``cudnn_attn.sdpa`` (causal)."""

    def attend(layer, q, k, v):
        q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, T, head_dim]
        return cudnn_attn.sdpa(q, k, v, is_causal=True, enable_gqa=True)[0].transpose(0, 1)

    t = torch.tensor(tokens, device=device)
    return model(t, torch.arange(len(tokens), device=device), attend)


# ---- the server ---------------------------------------------------------------------------------


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_new: int


@dataclass
class Sequence:
    """A request being served: its tokens so far, its pages, its slot (row of the decode step)."""

    request: Request
    slot: int
    pages: list[int]
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None  # those that chose the last token
    joined_at: int = 0  # decode steps run before it joined
    prefilled_with: int = 1  # prompts in its prefill, its own included

    @property
    def done(self) -> bool:
        return len(self.tokens) - len(self.request.prompt) == self.request.max_new


def pages_needed(request: Request) -> int:
    return math.ceil((len(request.prompt) + request.max_new - 1) / PAGE)  # the last token is never cached


class Server:
    """Continuous batching over a paged K/V cache, with the decode step's inputs and output in
    fixed buffers of ``MAX_BATCH`` rows (what a captured step reads and writes)."""

    def __init__(self, model: TinyLM):
        self.model = model
        # Random, not zeros: a read of a slot no request wrote (or a stale page) shows in the checks.
        self.caches = [
            [torch.randn(NUM_PAGES, KV_HEADS, PAGE, HEAD_DIM, device=device, dtype=dtype) for _ in range(2)]
            for _ in range(LAYERS)
        ]
        self.attn = cudnn_attn.PagedAttention(
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            PAGE,
            dtype=dtype,
            device=device,
            max_batch=MAX_BATCH,
            max_pages_per_seq=MAX_PAGES,
            cuda_graph=gpu,
        )
        self.free_pages = random.Random(0).sample(range(1, NUM_PAGES), NUM_PAGES - 1)  # handed out in no order
        self.step_inputs = torch.zeros(4, MAX_BATCH, dtype=torch.long, device=device)  # token, position, page, offset
        self.attn_out = torch.empty(MAX_BATCH, HEADS, 1, HEAD_DIM, device=device, dtype=dtype)
        self.logits = torch.empty(MAX_BATCH, VOCAB, device=device)
        self.decode = self._capture() if gpu else self._decode_layers

    # ---- one decode step: every layer appends its new K/V, then attends through the plan ---------

    def _decode_layers(self) -> None:
        tokens, positions, pages, offsets = self.step_inputs

        def attend(layer, q, k, v):
            k_cache, v_cache = self.caches[layer]
            k_cache[pages, :, offsets] = k  # NHPD: [page, kv head, slot in page, head dim]
            v_cache[pages, :, offsets] = v
            return self.attn.run(q.unsqueeze(2), k_cache, v_cache, out=self.attn_out).squeeze(2)

        self.logits.copy_(self.model(tokens, positions, attend))

    def _capture(self):
        """The decode step captured once (after a warm-up that builds its plans); each later step
        is plan() (which rewrites the buffers the graph reads) and replay()."""
        self._plan({})  # padding rows only
        self._decode_layers()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._decode_layers()
        return graph.replay

    def _plan(self, running: dict[int, Sequence]) -> None:
        """The step's page table, lengths and inputs, padded to MAX_BATCH rows: a free slot's row
        reads and writes one token on the scratch page."""
        table = [[0] * MAX_PAGES for _ in range(MAX_BATCH)]
        lengths = [1] * MAX_BATCH
        inputs = [[0] * MAX_BATCH for _ in range(4)]  # token, position, page, offset
        for slot, seq in running.items():
            position = len(seq.tokens) - 1  # the last token, fed now, its K/V cached now
            table[slot][: len(seq.pages)] = seq.pages
            lengths[slot] = position + 1
            for row, value in zip(inputs, (seq.tokens[-1], position, seq.pages[position // PAGE], position % PAGE)):
                row[slot] = value
        self.step_inputs.copy_(torch.tensor(inputs))
        self.attn.plan(torch.tensor(table, dtype=torch.int32), torch.tensor(lengths, dtype=torch.int32))

    # ---- prefill: the joining prompts packed, their K/V written into their pages ---------------------

    def _prefill(self, joining: list[Sequence]) -> torch.Tensor:
        """Logits at each joining prompt's last token."""
        lengths = [len(seq.request.prompt) for seq in joining]
        positions = torch.cat([torch.arange(n) for n in lengths])
        pages = torch.cat([torch.tensor(seq.pages)[torch.arange(n) // PAGE] for seq, n in zip(joining, lengths)])
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        tokens = torch.tensor([t for seq in joining for t in seq.request.prompt])
        tokens, positions, pages, offsets, cu = (t.to(device) for t in (tokens, positions, pages, positions % PAGE, cu))

        def attend(layer, q, k, v):
            k_cache, v_cache = self.caches[layer]
            k_cache[pages, :, offsets] = k
            v_cache[pages, :, offsets] = v
            return cudnn_attn.varlen_sdpa(q, k, v, cu, cu, max(lengths), max(lengths), is_causal=True, enable_gqa=True)

        return self.model(tokens, positions, attend, last=(cu[1:] - 1).long())

    # ---- the loop ---------------------------------------------------------------------------------

    def serve(self, requests: list[Request], record: bool = False) -> dict:
        """Serve ``requests`` (all waiting at the start) to the end. With ``record``, some decode
        rows and every prefill's last-token logits are kept for the checks."""
        waiting, running = deque(requests), {}  # running: by slot
        done: dict[int, Sequence] = {}
        step_seconds: list[float] = []
        records: dict[str, list] = {"decode": [], "prefill": []}
        prefills = 0
        started = time.perf_counter()
        while waiting or running:
            joining = []
            free_slots = [slot for slot in range(MAX_BATCH) if slot not in running]
            while waiting and free_slots and pages_needed(waiting[0]) <= len(self.free_pages):
                request = waiting.popleft()
                pages = [self.free_pages.pop() for _ in range(pages_needed(request))]
                seq = Sequence(request, free_slots.pop(0), pages, list(request.prompt), joined_at=len(step_seconds))
                running[seq.slot] = seq
                joining.append(seq)
            if joining:
                prefills += 1
                logits = self._prefill(joining)
                for seq, row, token in zip(joining, logits, logits.argmax(-1).tolist()):
                    seq.prefilled_with = len(joining)
                    seq.tokens.append(token)
                    seq.logits = row
                    if record:
                        records["prefill"].append((seq.request.prompt, row))
            decoding = {slot: seq for slot, seq in running.items() if not seq.done}
            if decoding:
                start = time.perf_counter()
                self._plan(decoding)
                self.decode()
                logits = self.logits[list(decoding)]
                tokens = logits.argmax(-1).tolist()  # waits for the step
                step_seconds.append(time.perf_counter() - start)
                if record and (len(step_seconds) - 1) % CHECK_EVERY == 0:
                    records["decode"] += [
                        (list(seq.tokens), row) for seq, row in list(zip(decoding.values(), logits))[:CHECK_ROWS]
                    ]
                for seq, row, token in zip(decoding.values(), logits, tokens):
                    seq.tokens.append(token)
                    seq.logits = row
            for slot, seq in list(running.items()):
                if seq.done:  # leaves: its slot and its pages are free for the next request
                    self.free_pages += seq.pages
                    done[seq.request.id] = running.pop(slot)
        return {
            "done": done,
            "seconds": time.perf_counter() - started,
            "step_seconds": step_seconds,
            "prefills": prefills,
            "records": records,
        }


# ---- checks -------------------------------------------------------------------------------------


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm())


def check(name: str, err: float, tol: float = 3e-2) -> None:
    print(f"  {name}: rel_err={err:.2e}")
    if not err < tol:  # also false for NaN
        raise SystemExit(f"{name}: relative error {err:.2e} over {tol}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


gen = torch.Generator().manual_seed(1)
requests = [
    Request(i, torch.randint(0, VOCAB, (int(n),), generator=gen).tolist(), int(m))
    for i, (n, m) in enumerate(
        zip(
            torch.randint(PROMPT_LENGTHS[0], PROMPT_LENGTHS[1] + 1, (REQUESTS,), generator=gen),
            torch.randint(NEW_TOKENS[0], NEW_TOKENS[1] + 1, (REQUESTS,), generator=gen),
        )
    )
]
model = TinyLM().to(device, dtype).eval()
print(
    f"serving on {device}: {LAYERS} layers, hidden {HIDDEN}, {HEADS} query / {KV_HEADS} KV heads of {HEAD_DIM}; "
    f"pages of {PAGE} tokens, {NUM_PAGES - 1} in the pool"
)
print(
    f"  {REQUESTS} requests: prompts {PROMPT_LENGTHS[0]}-{PROMPT_LENGTHS[1]} tokens, {NEW_TOKENS[0]}-{NEW_TOKENS[1]} "
    f"new tokens each, at most {MAX_BATCH} at a time{' (decode step in a CUDA graph)' if gpu else ''}"
)

cache = cudnn_attn.default_cache()
with torch.inference_mode():
    server = Server(model)
    server.serve(requests)  # warm-up: every plan built (prefill buckets, the decode step)
    built, build_seconds = cache.stats()["builds"], cache.stats()["build_seconds"]
    plans_before = server.attn.plans
    result = server.serve(requests, record=True)
    stats = cache.stats()

generated = sum(len(seq.tokens) - len(seq.request.prompt) for seq in result["done"].values())
steps = result["step_seconds"]
print(
    f"  {generated} tokens in {result['seconds']:.2f} s: {generated / result['seconds']:,.0f} tokens/s; "
    f"{result['prefills']} prefills, {len(steps)} decode steps of p50 {percentile(steps, 0.5) * 1e3:.2f} ms, "
    f"p99 {percentile(steps, 0.99) * 1e3:.2f} ms"
)
print(
    f"  plans built: {built} in the warm-up pass ({build_seconds:.2f} s), {stats['builds'] - built} in the timed "
    f"pass; PagedAttention.plan() ran {server.attn.plans - plans_before} times, once per decode step"
)
if any(len(seq.tokens) != len(seq.request.prompt) + seq.request.max_new for seq in result["done"].values()):
    raise SystemExit("a request did not get the tokens it asked for")

with torch.inference_mode():
    # 1. Decode through the paged cache = the same model on the whole sequence, no cache.
    decode_records = result["records"]["decode"]
    worst = max(rel_err(row, dense_logits(model, tokens)[-1]) for tokens, row in decode_records)
    check(f"decode logits, paged vs dense on the whole sequence (worst of {len(decode_records)} rows)", worst)

    # 2. Packed prefill = each prompt alone, dense.
    prefill_records = result["records"]["prefill"][:8]
    worst = max(rel_err(row, dense_logits(model, prompt)[-1]) for prompt, row in prefill_records)
    check(f"prefill logits, packed varlen vs dense per prompt (worst of {len(prefill_records)})", worst)

    # 3. Batching changes nothing: a request served alone writes the same tokens as in the batch.
    # It is the last to join mid-stream (on recycled pages) with a prefill of its own: a packed
    # prefill multiplies matrices of another height, whose rounding may differ in the last bit
    # (check 2 bounds that) and so flip a near-tie between two tokens.
    joined = [seq for seq in result["done"].values() if seq.joined_at > 0 and seq.prefilled_with == 1]
    batched = max(joined, key=lambda seq: seq.joined_at) if joined else result["done"][requests[-1].id]
    request = batched.request
    alone = server.serve([request])["done"][request.id]
    if alone.tokens != batched.tokens:
        first = next(i for i, (a, b) in enumerate(zip(alone.tokens, batched.tokens)) if a != b)
        raise SystemExit(f"request {request.id}: token {first - len(request.prompt)} differs alone and in the batch")
    check(
        f"request {request.id} (joined at decode step {batched.joined_at}) alone: its {request.max_new} tokens "
        "equal the batch's; final logits",
        rel_err(batched.logits, alone.logits),
    )
print("all results match")
