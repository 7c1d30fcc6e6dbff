#!/usr/bin/env python3
"""The PyTorch side of io_interop_test: a GPT-2 written here in plain PyTorch (no transformers, no download).

The modules mirror Hugging Face's GPT2LMHeadModel: the same parameter names (transformer.wte, transformer.h.N.attn.
c_attn, ...), Conv1D weights stored [in, out], LayerNorm eps 1e-5, GELU with the tanh approximation, a causal
mask buffer h.N.attn.bias, and lm_head tied to wte. So a file that loads here with no unexpected and no
missing parameters loads into transformers' GPT-2 of the same configuration.

  interop_gpt2.py forward MODEL TOKENS OUT V CTX C L H
      loads MODEL (shardkit's export), computes the logits of TOKENS (I64 [B, T]) and writes them to OUT ("logits")
  interop_gpt2.py export MODEL TOKENS OUT V CTX C L H SEED
      initialises a model from SEED, writes its GPT2Model state dict (no "transformer." prefix, mask buffers
      included, as the original "gpt2" checkpoint) to MODEL, and the logits of TOKENS to OUT
"""
import math
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn


class Conv1D(nn.Module):
    """GPT-2's projection: y = x @ W + b with W [in, out]."""

    def __init__(self, out_features, in_features):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(in_features, out_features) * 0.02)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x):
        return x @ self.weight + self.bias


class Attention(nn.Module):
    def __init__(self, ctx, width, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = Conv1D(3 * width, width)
        self.c_proj = Conv1D(width, width)
        self.register_buffer("bias", torch.tril(torch.ones(ctx, ctx)).view(1, 1, ctx, ctx))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.c_fc = Conv1D(4 * width, width)
        self.c_proj = Conv1D(width, 4 * width)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, ctx, width, heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width, eps=1e-5)
        self.attn = Attention(ctx, width, heads)
        self.ln_2 = nn.LayerNorm(width, eps=1e-5)
        self.mlp = MLP(width)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, vocab, ctx, width, layers, heads):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(ctx, width)
        self.h = nn.ModuleList(Block(ctx, width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width, eps=1e-5)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    def __init__(self, vocab, ctx, width, layers, heads):
        super().__init__()
        self.transformer = GPT2Model(vocab, ctx, width, layers, heads)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied

    def forward(self, idx):
        return self.lm_head(self.transformer(idx))


def build(argv):
    vocab, ctx, width, layers, heads = (int(a) for a in argv)
    return GPT2LMHeadModel(vocab, ctx, width, layers, heads)


def forward(model_path, tokens_path, out_path, config):
    model = build(config)
    state = load_file(model_path)
    if "wte.weight" in state:  # GPT2Model names: add GPT2LMHeadModel's prefix
        state = {k if k == "lm_head.weight" else "transformer." + k: v for k, v in state.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} | {f"transformer.h.{i}.attn.bias" for i in range(int(config[3]))}
    if unexpected or set(missing) - allowed_missing:
        print(f"MISMATCH unexpected keys {unexpected}, missing keys {sorted(set(missing) - allowed_missing)}")
        return 1
    tokens = load_file(tokens_path)["tokens"]
    with torch.no_grad():
        logits = model(tokens)
    save_file({"logits": logits.contiguous()}, out_path)
    print(f"torch {torch.__version__}: loaded {len(state)} tensors, logits {list(logits.shape)}")
    return 0


def export(model_path, tokens_path, out_path, config, seed):
    torch.manual_seed(seed)
    model = build(config)
    with torch.no_grad():  # values far from the init, so a swapped or untransposed tensor cannot go unnoticed
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.copy_((1.0 if name.endswith("weight") else 0.0) + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    state = {k: v.contiguous() for k, v in model.transformer.state_dict().items()}
    save_file(state, model_path, metadata={"format": "pt"})
    tokens = load_file(tokens_path)["tokens"]
    with torch.no_grad():
        logits = model(tokens)
    save_file({"logits": logits.contiguous()}, out_path)
    print(f"torch {torch.__version__}: wrote {len(state)} tensors, logits {list(logits.shape)}")
    return 0


def main():
    mode = sys.argv[1]
    if mode == "forward":
        return forward(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:10])
    if mode == "export":
        return export(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:10], int(sys.argv[10]))
    print(f"unknown mode {mode}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
