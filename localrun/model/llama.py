"""The llama-family transformer (Llama 2/3, Mistral, SmolLM2) as llama.cpp lays out its GGUF.

Transformer -> Block -> Attention / FeedForward, gpt-fast style, with fused QKV and gate/up
weights. One forward runs a flat batch of T tokens that may belong to several sequences:
the matmuls see all T tokens at once, attention runs per sequence segment on its KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from localrun.config import ModelConfig


@dataclass
class Segment:
    """One sequence's tokens inside a flat batch: rows start..start+length-1 of the batch,
    at positions cache_start..cache_start+length-1 of `cache`."""
    start: int
    length: int
    cache_start: int
    cache: object          # has .update(layer, start, k, v) -> (k_all, v_all), (n_kv, L, hd)


def rope_table(config: ModelConfig, max_positions: int, rope_freqs: torch.Tensor | None) -> torch.Tensor:
    """cos + i sin of position * theta_i, (max_positions, rope_dim/2) complex64.
    llama.cpp's "normal" RoPE rotates adjacent pairs (x[2i], x[2i+1]); the GGUF converter
    permutes Q/K rows so that this equals the reference model's rotation."""
    dim = config.rope_dim
    inv_freq = 1.0 / (config.rope_base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope_freqs is not None:          # Llama 3.x long-context frequency factors
        inv_freq = inv_freq / rope_freqs.double()
    positions = torch.arange(max_positions, dtype=torch.float64) / config.rope_scaling_factor
    angles = torch.outer(positions, inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x (T, H, hd), freqs (T, hd/2) complex -> x rotated, same dtype."""
    pairs = torch.view_as_complex(x.float().unflatten(-1, (-1, 2)))     # (T, H, hd/2)
    return torch.view_as_real(pairs * freqs[:, None, :]).flatten(-2).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight, self.eps = weight, eps        # weight float32 (D,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, wqkv: torch.Tensor, wo: torch.Tensor, layer: int):
        super().__init__()
        self.wqkv, self.wo, self.layer = wqkv, wo, layer   # (q+2kv dims, D), (D, q dims)
        self.n_head, self.n_head_kv, self.head_dim = config.n_head, config.n_head_kv, config.head_dim

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        T, hd = x.shape[0], self.head_dim
        q_dim, kv_dim = self.n_head * hd, self.n_head_kv * hd
        q, k, v = F.linear(x, self.wqkv).split([q_dim, kv_dim, kv_dim], dim=-1)
        q = apply_rope(q.view(T, self.n_head, hd), freqs)          # (T, H, hd)
        k = apply_rope(k.view(T, self.n_head_kv, hd), freqs)       # (T, n_kv, hd)
        v = v.view(T, self.n_head_kv, hd)
        if len(segments) == 1:
            out = self._attend(q, k, v, segments[0])
        else:
            out = torch.cat([self._attend(q[s.start:s.start + s.length], k[s.start:s.start + s.length],
                                          v[s.start:s.start + s.length], s) for s in segments])
        return F.linear(out.reshape(T, q_dim), self.wo)

    def _attend(self, q, k, v, seg: Segment) -> torch.Tensor:
        """Causal attention of one segment's queries over its cached prefix plus itself."""
        k_all, v_all = seg.cache.update(self.layer, seg.cache_start, k, v)   # (n_kv, L, hd)
        t, L = q.shape[0], k_all.shape[1]
        mask, causal = None, False
        if t > 1 and L == t:
            causal = True
        elif t > 1:   # new tokens are the last t of L: query i sees keys 0..L-t+i
            mask = torch.ones(t, L, dtype=torch.bool, device=q.device).tril(L - t)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_all[None], v_all[None],
                                             attn_mask=mask, is_causal=causal, enable_gqa=True)
        return out[0].transpose(0, 1)                                # (t, H, hd)


class FeedForward(nn.Module):
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w13, self.w2 = w13, w2        # (2*F, D) gate then up, (D, F)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w13).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.w2)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, w: dict[str, torch.Tensor], layer: int):
        super().__init__()
        p = f"blk.{layer}."
        wqkv = torch.cat([w[p + "attn_q.weight"], w[p + "attn_k.weight"], w[p + "attn_v.weight"]])
        w13 = torch.cat([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]])
        self.attention_norm = RMSNorm(w[p + "attn_norm.weight"], config.rms_eps)
        self.attention = Attention(config, wqkv, w[p + "attn_output.weight"], layer)
        self.ffn_norm = RMSNorm(w[p + "ffn_norm.weight"], config.rms_eps)
        self.feed_forward = FeedForward(w13, w[p + "ffn_down.weight"])

    def forward(self, x, freqs, segments):
        h = x + self.attention(self.attention_norm(x), freqs, segments)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, max_positions: int):
        super().__init__()
        self.config = config
        self.tok_embeddings = weights["token_embd.weight"]                     # (V, D)
        self.output = self.tok_embeddings if config.tied_output else weights["output.weight"]
        self.layers = nn.ModuleList(Block(config, weights, i) for i in range(config.n_layers))
        self.norm = RMSNorm(weights["output_norm.weight"], config.rms_eps)
        self.freqs = rope_table(config, max_positions, weights.get("rope_freqs.weight"))
        self.dtype = self.tok_embeddings.dtype

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                logits_rows: torch.Tensor | None = None) -> torch.Tensor:
        """tokens, positions (T,) -> float32 logits (len(logits_rows) or T, V)."""
        x = self.tok_embeddings[tokens]                                      # (T, D)
        freqs = self.freqs[positions]                                        # (T, hd/2)
        for layer in self.layers:
            x = layer(x, freqs, segments)
        if logits_rows is not None:
            x = x[logits_rows]
        return F.linear(self.norm(x), self.output).float()
