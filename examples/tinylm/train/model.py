"""TinyLM: a small Llama-architecture decoder (see ../MODEL.md for the exact spec).

RMSNorm (pre-norm), RoPE (NeoX rotate_half pairing, positions from 0), GQA,
SwiGLU MLP, no biases, untied input embedding / output head, final RMSNorm.

Runs with Debian's PyTorch 1.13 (/usr/bin/python3).
"""
import math
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Config:
    vocab_size: int = 256
    n_layers: int = 2
    d_model: int = 128
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 16
    ffn_dim: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 4096
    tie_embeddings: bool = False

    def to_dict(self):
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim, max_len, theta):
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, dtype=torch.float64) * 2.0 / head_dim))
    pos = torch.arange(max_len, dtype=torch.float64)
    ang = torch.outer(pos, inv_freq)                  # [T, half]
    ang = torch.cat([ang, ang], dim=-1)               # [T, head_dim]: dim i and i+half share a frequency
    return ang.cos().float(), ang.sin().float()


def apply_rope(x, cos, sin):
    # x: [..., T, head_dim]; NeoX style: rotate_half(x) = cat(-x2, x1)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = torch.cat([-x2, x1], dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.wq = nn.Linear(c.d_model, c.n_heads * c.head_dim, bias=False)
        self.wk = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wv = nn.Linear(c.d_model, c.n_kv_heads * c.head_dim, bias=False)
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=False)

    def forward(self, x, cos, sin, mask, return_probs=False):
        c = self.c
        B, T, _ = x.shape
        KV, G, hd = c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim
        # query head h = kv*G + g uses kv head h // G
        q = self.wq(x).view(B, T, KV, G, hd).permute(0, 2, 3, 1, 4)   # [B,KV,G,T,hd]
        k = self.wk(x).view(B, T, KV, hd).permute(0, 2, 1, 3)         # [B,KV,T,hd]
        v = self.wv(x).view(B, T, KV, hd).permute(0, 2, 1, 3)
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        s = torch.matmul(q.reshape(B, KV, G * T, hd), k.transpose(-1, -2))
        s = s.view(B, KV, G, T, T) * (1.0 / math.sqrt(hd)) + mask
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p.view(B, KV, G * T, T), v).view(B, KV, G, T, hd)
        o = o.permute(0, 3, 1, 2, 4).reshape(B, T, KV * G * hd)
        out = self.wo(o)
        if return_probs:
            return out, p.reshape(B, KV * G, T, T)
        return out


class FeedForward(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.w1 = nn.Linear(c.d_model, c.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(c.d_model, c.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(c.ffn_dim, c.d_model, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.attention_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attention = Attention(c)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.feed_forward = FeedForward(c)
        self.keep_probs = False   # training: keep attention probabilities [B,H,T,T] in .probs
        self.probs = None

    def forward(self, x, cos, sin, mask):
        a = self.attention(self.attention_norm(x), cos, sin, mask, return_probs=self.keep_probs)
        if self.keep_probs:
            a, self.probs = a
        x = x + a
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class TinyLM(nn.Module):
    def __init__(self, c: Config):
        super().__init__()
        self.c = c
        self.tok_embeddings = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.output = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        cos, sin = rope_tables(c.head_dim, c.max_seq_len, c.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init)
        for n, p in self.named_parameters():
            if n.endswith("wo.weight") or n.endswith("w2.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * c.n_layers))

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def hidden(self, ids):
        B, T = ids.shape
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        mask = torch.full((T, T), float("-inf")).triu(1)
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)
        return self.norm(x)

    def forward(self, ids):
        return self.output(self.hidden(ids))

    @torch.no_grad()
    def greedy(self, prompt_ids, n_new):
        """Greedy decoding of n_new tokens (full KV: recompute; prompts are short enough)."""
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
        out = []
        for _ in range(n_new):
            nxt = int(self.forward(ids)[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        return out
