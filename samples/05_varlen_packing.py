"""Training on a dataset of mixed lengths by packing, not padding: sequences are laid back to
back into batches of a token budget and attention runs per sequence through
``cudnn_attn.varlen_sdpa``, so no work is spent on padding.

    python samples/05_varlen_packing.py

Runs on a GPU (cuDNN) or, smaller, on the CPU (the reference backend).
"""

from __future__ import annotations

import time

import torch

import cudnn_attn

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16
gpu = device == "cuda"
torch.manual_seed(0)
VOCAB, HIDDEN, HEADS, KV_HEADS = 512, 256, 8, 2
HEAD_DIM = HIDDEN // HEADS
BUDGET = 8192 if gpu else 768  # tokens per packed batch
MIN_LEN, MAX_LEN = (128, 2048) if gpu else (16, 256)

# 1. A dataset of token sequences of mixed lengths (a stand-in for tokenised documents): each
# counts up from a random start by a step of its own, so the next token is learnable in context.
dataset = [
    (torch.randint(0, VOCAB, ()) + torch.randint(1, 4, ()) * torch.arange(int(n))) % VOCAB
    for n in torch.randint(MIN_LEN, MAX_LEN + 1, (48 if gpu else 20,))
]


def packed_batches(docs: list[torch.Tensor], budget: int):
    """Greedy packing: documents back to back until the next would pass the token budget.
    Yields (tokens [T], cu_seqlens int32 [B + 1], longest length)."""
    batch: list[torch.Tensor] = []
    for doc in docs + [None]:  # type: ignore[list-item]
        if doc is None or (batch and sum(len(d) for d in batch) + len(doc) > budget):
            lengths = torch.tensor([len(d) for d in batch])
            cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
            yield torch.cat(batch), cu, int(lengths.max())
            batch = []
        if doc is not None:
            batch.append(doc[:budget])


class Block(torch.nn.Module):
    """Pre-norm decoder block whose attention runs per packed sequence."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(HIDDEN), torch.nn.LayerNorm(HIDDEN)
        self.qkv = torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.out = torch.nn.Linear(HIDDEN, HIDDEN)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.GELU(), torch.nn.Linear(4 * HIDDEN, HIDDEN)
        )

    def forward(self, x, cu, longest):
        q, k, v = self.qkv(self.norm1(x)).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
        q, k, v = (t.unflatten(-1, (-1, HEAD_DIM)) for t in (q, k, v))  # [T, heads, head_dim]: views, no copy
        attn = cudnn_attn.varlen_sdpa(q, k, v, cu, cu, longest, longest, is_causal=True, enable_gqa=True)
        x = x + self.out(attn.flatten(-2))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(layers))
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens, cu, longest):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, cu, longest)
        return self.head(x)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def check(name: str, err: float, tol: float) -> None:
    print(f"  {name}: rel_err={err:.2e}")
    if not err < tol:  # also false for NaN
        raise SystemExit(f"{name}: relative error {err:.2e} over {tol}")


model = TinyLM().to(device, dtype)
tokens, cu, longest = next(packed_batches(dataset, BUDGET))
tokens, cu = tokens.to(device), cu.to(device)

# 2. Packing changes nothing: the packed batch's logits equal each document's run alone.
with torch.no_grad():
    packed_logits = model(tokens, cu, longest)
    alone = [
        model(tokens[s:e], torch.tensor([0, e - s], dtype=torch.int32, device=device), e - s)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())
    ]
check("packed logits vs each document alone", rel_err(packed_logits, torch.cat(alone)), 2e-2)

# 3. The attention itself against torch's SDPA per document, values and gradients.
q, k, v = (
    torch.randn(int(cu[-1]), h, HEAD_DIM, device=device, dtype=dtype, requires_grad=True)
    for h in (HEADS, KV_HEADS, KV_HEADS)
)
out = cudnn_attn.varlen_sdpa(q, k, v, cu, cu, longest, longest, is_causal=True, enable_gqa=True)
out.float().square().mean().backward()
leaves = [x.detach().float().requires_grad_() for x in (q, k, v)]
per_doc = [
    torch.nn.functional.scaled_dot_product_attention(
        *(x[s:e].transpose(0, 1) for x in leaves), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())
]
expected = torch.cat(per_doc)
expected.square().mean().backward()
check("varlen_sdpa vs torch per document", rel_err(out, expected), 2e-2)
check("dq vs torch per document", rel_err(q.grad, leaves[0].grad), 3e-2)

# 4. Train on the packed dataset: next-token loss inside each document (no target crosses a boundary).
optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
losses, seen, started = [], 0, time.perf_counter()
batches = list(packed_batches(dataset, BUDGET))
for _epoch in range(3):
    for tokens, cu, longest in batches:
        tokens, cu = tokens.to(device), cu.to(device)
        targets = tokens.roll(-1).clone()
        targets[(cu[1:] - 1).long()] = -100  # each document's last token predicts nothing
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(tokens, cu, longest).float(), targets, ignore_index=-100)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        seen += tokens.numel()
if gpu:
    torch.cuda.synchronize()
elapsed = time.perf_counter() - started
padded = sum((len(cu) - 1) * longest for _, cu, longest in batches)
packed_tokens = sum(len(tokens) for tokens, _, _ in batches)
print(
    f"  {len(batches)} packed batches of <= {BUDGET} tokens; padding each to its longest document would "
    f"process {padded / packed_tokens:.2f}x the tokens"
)
print(
    f"  loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps, {seen / elapsed:,.0f} tokens/s on {device}"
)
if not losses[-1] < losses[0]:
    raise SystemExit(f"the loss did not fall: {losses[0]:.3f} -> {losses[-1]:.3f}")
print("all results match")
