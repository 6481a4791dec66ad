"""The session predictor's size and speed against LPC's prompt embedder (the paper: ~1 M against 118 M parameters,
8.8x the inference throughput).

Both are timed as models only, in this process, one after the other, on the same inputs:

* ours: :class:`agents.session_predictor.SessionPredictor` (the 3-layer MLP over 81 structural + 1,536 text features,
  the width of Qwen2.5-1.5B's hidden state that the paper feeds it), forward pass on feature rows;
* LPC's embedder: a stand-in with the architecture of ``paraphrase-multilingual-MiniLM-L12-v2`` (the 118 M-parameter
  sentence encoder: 250,002-token vocabulary, 12 BERT layers of width 384, 12 heads, feed-forward 1,536, mean pooling),
  randomly initialised: no weights are downloaded, and the arithmetic of a forward pass does not depend on them. Its
  inputs are the first user prompts of the embedded WildChat conversations, tokenized (our approximate tokenizer) and
  cut at 128 tokens, that model's default maximum sequence length.

Reported: parameters of each, requests per second at batch 1 and at batch ``--batch`` (prompts padded to the longest
in the batch, with an attention mask), and the ratio ours / embedder. ``torch.set_num_threads(--threads)``; the
best of ``--repeats`` timing rounds of ``--min-s`` seconds each (the machine is shared: the best round is the least
disturbed). Wall-clock figures: they vary with the host.

    python benchmarks/predictor_bench.py [--batch 64] [--threads 1] [--repeats 3] [--min-s 0.5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from agents.session_predictor import SessionPredictor
from sae_env.files import write_json
from sae_env.inputs import open_text
from sae_env.tokenizer import get_tokenizer

VOCAB, WIDTH, LAYERS, HEADS, FFN, MAX_LEN = 250_002, 384, 12, 12, 1536, 128


class MiniLMEncoder(nn.Module):
    """BERT-style encoder of paraphrase-multilingual-MiniLM-L12-v2's shape with mean pooling (random weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, WIDTH)
        self.positions = nn.Embedding(512, WIDTH)
        self.types = nn.Embedding(2, WIDTH)
        self.norm = nn.LayerNorm(WIDTH, eps=1e-12)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, FFN, dropout=0.0, activation="gelu", batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1]).unsqueeze(0)
        x = self.norm(self.tokens(ids) + self.positions(pos) + self.types(torch.zeros_like(ids)))
        x = self.encoder(x, src_key_padding_mask=~mask)
        m = mask.unsqueeze(-1).to(x.dtype)
        return (x * m).sum(1) / m.sum(1).clamp(min=1.0)


def first_prompts(limit: int = 512) -> list[list[int]]:
    """Token ids of the first user message of each WildChat conversation, cut at MAX_LEN."""
    from sae_env import data

    tok = get_tokenizer(None)
    out = []
    with open_text(data.WILDCHAT) as f:
        for line in f:
            msgs = json.loads(line)["messages"]
            text = next((m["content"] for m in msgs if m["role"] == "user" and isinstance(m["content"], str)), None)
            if text:
                out.append([i % VOCAB for i in tok.encode(text)][:MAX_LEN] or [0])
            if len(out) >= limit:
                break
    return out


def batches(prompts: list[list[int]], size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for k in range(0, len(prompts) - size + 1, size):
        chunk = prompts[k:k + size]
        n = max(len(p) for p in chunk)
        ids = torch.zeros((size, n), dtype=torch.long)
        mask = torch.zeros((size, n), dtype=torch.bool)
        for i, p in enumerate(chunk):
            ids[i, :len(p)] = torch.tensor(p)
            mask[i, :len(p)] = True
        out.append((ids, mask))
    return out


def rate(step: Callable[[int], int], min_s: float, repeats: int) -> float:
    """Best requests/s over ``repeats`` rounds; ``step(k)`` runs the k-th call and returns the requests it served."""
    step(0)  # warm-up
    best = 0.0
    for _ in range(repeats):
        n, k = 0, 0
        t0 = time.perf_counter()
        while (dt := time.perf_counter() - t0) < min_s:
            n += step(k)
            k += 1
        best = max(best, n / dt)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-s", type=float, default=0.5)
    ap.add_argument("--json", help="write the figures as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    ours = SessionPredictor()
    ours.model.eval()
    embedder = MiniLMEncoder().eval()
    prompts = first_prompts()
    rng = np.random.default_rng(0)
    feats = torch.from_numpy(rng.standard_normal((max(args.batch, 256), ours.in_dim)).astype(np.float32))
    one = [b for b in batches(prompts, 1)]
    many = batches(prompts, args.batch)

    def ours_step(size: int) -> Callable[[int], int]:
        def step(k: int) -> int:
            with torch.inference_mode():
                ours.model(feats[:size])
            return size
        return step

    def embed_step(bs: list[tuple[torch.Tensor, torch.Tensor]]) -> Callable[[int], int]:
        def step(k: int) -> int:
            ids, mask = bs[k % len(bs)]
            with torch.inference_mode():
                embedder(ids, mask)
            return ids.shape[0]
        return step

    out = {
        "ours_params": ours.n_params,
        "embedder_params": sum(p.numel() for p in embedder.parameters()),
        "prompt_tokens_median": float(np.median([len(p) for p in prompts])),
        "threads": args.threads, "batch": args.batch,
    }
    for label, size, bs in (("batch1", 1, one), (f"batch{args.batch}", args.batch, many)):
        r_ours = rate(ours_step(size), args.min_s, args.repeats)
        r_emb = rate(embed_step(bs), args.min_s, args.repeats)
        out[f"ours_{label}_rps"] = r_ours
        out[f"embedder_{label}_rps"] = r_emb
        out[f"ratio_{label}"] = r_ours / r_emb
    print(f"parameters: ours {out['ours_params']:,}, LPC embedder stand-in {out['embedder_params']:,} "
          f"({out['embedder_params'] / out['ours_params']:.0f}x); prompts: median {out['prompt_tokens_median']:.0f} "
          f"tokens (cut at {MAX_LEN}); {args.threads} thread(s)")
    for label in ("batch1", f"batch{args.batch}"):
        print(f"{label}: ours {out[f'ours_{label}_rps']:,.0f} req/s, embedder {out[f'embedder_{label}_rps']:,.1f} "
              f"req/s, ratio {out[f'ratio_{label}']:,.0f}x")
    if args.json:
        write_json(args.json, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
