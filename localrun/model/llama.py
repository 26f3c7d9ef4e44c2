"""The llama-family transformer (Llama 2/3, Mistral, SmolLM2) as llama.cpp lays out its GGUF.

Transformer -> Block -> Attention / FeedForward, gpt-fast style, with fused QKV and gate/up
weights. One forward runs a flat batch of T tokens that may belong to several sequences:
the matmuls see all T tokens at once, attention runs per sequence segment on its KV cache.

Weights are callables `w(x) == x @ W.T` (localrun/model/quant.py): dense tensors on the
reference path, int4/int8 codes for torch's weight-only kernels on the fast path. Each layer
sits on the device its `DeviceMap` names (localrun/placement.py); the activations move to the
next device once, where the device group changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from localrun import kernels
from localrun.config import ModelConfig
from localrun.model.quant import FileTensor, Int8Weight, PlainWeight, int8_backend, make_embedding, make_weight
from localrun.placement import DeviceMap, all_on


@dataclass
class Segment:
    """One sequence's tokens inside a flat batch: rows start..start+length-1 of the batch,
    at positions cache_start..cache_start+length-1 of `cache`.
    rowwise: attend each row on its own, as a one-token decode step would (one query over its
    prefix), rather than all rows at once under a causal mask. Same cache write and read,
    `length` small attention calls: used to verify speculative drafts, whose rows must round
    exactly as plain decoding rounds them (see ModelRunner)."""
    start: int
    length: int
    cache_start: int
    cache: object          # has .update(layer, start, k, v) -> (k_all, v_all), (n_kv, L, hd)
    rowwise: bool = False


@dataclass
class PagedRows:
    """The leading decode and verify rows of a batch (one query each over its own prefix),
    attended in one kernel call per layer straight from a float32 KV pool
    (localrun::paged_attention), with no gather and no loop over sequences. Built once per
    forward by the model runner, which then passes segments for the later rows only."""
    num_rows: int
    slots: torch.Tensor           # (T,) where each row's K/V is written
    block_tables: torch.Tensor    # (S, max_blocks) int64, padded
    row_seq: torch.Tensor         # (T,) the row's sequence: a row of block_tables
    row_len: torch.Tensor         # (T,) keys the row sees: its position + 1
    block_size: int
    pools: object                 # layer -> (k_pool, v_pool), each (num_blocks * block_size, n_kv, hd)


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
    if x.dtype != torch.float32:
        return apply_rope(x.float(), freqs).to(x.dtype)
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))             # (T, H, hd/2)
    return torch.view_as_real(pairs * freqs[:, None, :]).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, fused: bool = False):
        super().__init__()
        self.weight, self.eps = weight, eps        # weight float32 (D,)
        self.fused = fused and weight.device.type == "cpu"     # localrun's one-call kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == torch.float32 and x.dim() == 2:
            return torch.ops.localrun.rms_norm(x, self.weight, self.eps)
        if x.dtype != torch.float32:                                     # normalize in float32
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, wqkv, wo, layer: int):
        super().__init__()
        self.wqkv, self.wo, self.layer = wqkv, wo, layer   # (q+2kv dims, D), (D, q dims)
        self.n_head, self.n_head_kv, self.head_dim = config.n_head, config.n_head_kv, config.head_dim

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, segments: list[Segment], decode_rows: int = 0,
                paged: PagedRows | None = None) -> torch.Tensor:
        T, H, n_kv = x.shape[0], self.n_head, self.n_head_kv
        qkv = self.wqkv(x, decode_rows).view(T, H + 2 * n_kv, self.head_dim)          # (T, H + 2 n_kv, hd)
        q, k = apply_rope(qkv[:, :H + n_kv], freqs).split([H, n_kv], dim=1)   # q and k rotated at once
        v = qkv[:, H + n_kv:]                                             # (T, n_kv, hd)
        if paged is not None:
            n = paged.num_rows
            k_pool, v_pool = paged.pools(self.layer)
            out = torch.ops.localrun.paged_attention(q[:n], k[:n], v[:n], k_pool, v_pool, paged.slots,
                                                      paged.block_tables, paged.row_seq, paged.row_len,
                                                      paged.block_size)          # (n, H, hd)
            if segments:            # the prompt chunks after those rows
                out = torch.cat([out] + [self._attend(q[s.start:s.start + s.length], k[s.start:s.start + s.length],
                                                      v[s.start:s.start + s.length], s) for s in segments])
        elif len(segments) == 1:
            out = self._attend(q, k, v, segments[0])
        else:
            out = torch.cat([self._attend(q[s.start:s.start + s.length], k[s.start:s.start + s.length],
                                          v[s.start:s.start + s.length], s) for s in segments])
        return self.wo(out.reshape(T, H * self.head_dim), decode_rows)

    def _attend(self, q, k, v, seg: Segment) -> torch.Tensor:
        """Causal attention of one segment's queries over its cached prefix plus itself."""
        k_all, v_all = seg.cache.update(self.layer, seg.cache_start, k, v)   # (n_kv, L, hd)
        t, L = q.shape[0], k_all.shape[1]
        if seg.rowwise and t > 1:     # row i: one query over keys 0..L-t+i, as a decode step
            return torch.cat([sdpa(q[i:i + 1], k_all[:, :L - t + i + 1], v_all[:, :L - t + i + 1])
                              for i in range(t)])
        mask, causal = None, False
        if t > 1 and L == t:
            causal = True
        elif t > 1:   # new tokens are the last t of L: query i sees keys 0..L-t+i
            mask = torch.ones(t, L, dtype=torch.bool, device=q.device).tril(L - t)
        return sdpa(q, k_all, v_all, mask, causal)


def sdpa(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, mask: torch.Tensor | None = None,
         causal: bool = False) -> torch.Tensor:
    """Queries (t, H, hd) over keys and values (n_kv, L, hd) -> (t, H, hd), grouped-query."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_all[None], v_all[None],
                                         attn_mask=mask, is_causal=causal, enable_gqa=True)
    return out[0].transpose(0, 1)


class FeedForward(nn.Module):
    def __init__(self, w13, w2, fused: bool = False):
        super().__init__()
        self.w13, self.w2 = w13, w2        # (2*F, D) gate then up, (D, F)
        self.fused = fused

    def forward(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        gate_up = self.w13(x, decode_rows)                                   # (T, 2F)
        if self.fused and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
            return self.w2(torch.ops.localrun.silu_mul(gate_up), decode_rows)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.w2(F.silu(gate).mul_(up), decode_rows)


class WeightBuilder:
    """Builds the model's weights on their devices, from dequantized tensors (`load_weights`,
    the reference) or from the file's tensors (`file_weights`), kept quantized if `quantized`."""

    def __init__(self, weights: dict, dtype: torch.dtype, quantized: bool):
        self.weights, self.dtype, self.quantized = weights, dtype, quantized

    def linear(self, names: list[str], device: str):
        parts = [self.weights[n] for n in names]
        if isinstance(parts[0], FileTensor):
            return make_weight(parts, torch.device(device), self.dtype, self.quantized)
        return PlainWeight(torch.cat(parts).to(device=device, dtype=self.dtype))

    def embedding(self, name: str, device: str):
        t = self.weights[name]
        if isinstance(t, FileTensor):
            return make_embedding(t, torch.device(device), self.dtype, self.quantized)
        return PlainWeight(t.to(device=device, dtype=self.dtype))

    def vector(self, name: str, device: str) -> torch.Tensor:
        t = self.weights[name]
        if isinstance(t, FileTensor):
            t = torch.from_numpy(t.to_float().reshape(-1).copy())
        return t.to(device=device, dtype=torch.float32)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, build: WeightBuilder, layer: int, device: str = "cpu", group: int = -1,
                 fused: bool = False):
        super().__init__()
        p = f"blk.{layer}."
        self.device, self.group = torch.device(device), group
        wqkv = build.linear([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], device)
        w13 = build.linear([p + "ffn_gate.weight", p + "ffn_up.weight"], device)
        self.fused = fused and self.device.type == "cpu"     # localrun's fused small ops (kernels)
        self.attention_norm = RMSNorm(build.vector(p + "attn_norm.weight", device), config.rms_eps, self.fused)
        self.attention = Attention(config, wqkv, build.linear([p + "attn_output.weight"], device), layer)
        self.ffn_norm = RMSNorm(build.vector(p + "ffn_norm.weight", device), config.rms_eps, self.fused)
        self.feed_forward = FeedForward(w13, build.linear([p + "ffn_down.weight"], device), self.fused)

    def forward(self, x, freqs, segments, decode_rows: int = 0, paged: PagedRows | None = None):
        attn = self.attention(self.attention_norm(x), freqs, segments, decode_rows, paged)
        if self.fused and attn.dtype == torch.float32:       # h = x + attn and its norm in one call
            h, normed = torch.ops.localrun.add_rms_norm(x, attn, self.ffn_norm.weight, self.ffn_norm.eps)
            return h + self.feed_forward(normed, decode_rows)
        h = x + attn
        return h + self.feed_forward(self.ffn_norm(h), decode_rows)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict, *, max_positions: int,
                 device_map: DeviceMap | None = None, quantized: bool = False, dtype: torch.dtype | None = None):
        """weights: name -> tensor (load_weights: dequantized) or FileTensor (file_weights; held
        quantized where a kernel exists when `quantized`). dtype: the compute dtype."""
        super().__init__()
        self.config = config
        embd = weights["token_embd.weight"]
        self.dtype = dtype or (embd.dtype if isinstance(embd, torch.Tensor) else torch.float32)
        self.device_map = dm = device_map or all_on("cpu", config.n_layers)
        assert len(dm.layer_devices) == config.n_layers
        build = WeightBuilder(weights, self.dtype, quantized)
        fused = quantized and kernels.available()      # the reference path keeps torch's ops
        self.fused = fused and all(torch.device(d).type == "cpu" for d in dm.layer_devices)
        self.tok_embeddings = build.embedding("token_embd.weight", dm.embedding_device)   # (V, D)
        self.output = self._head(build, dm)                                              # (V, D)
        self.layers = nn.ModuleList(Block(config, build, i, dm.layer_devices[i], dm.layer_groups[i], fused)
                                    for i in range(config.n_layers))
        self.norm = RMSNorm(build.vector("output_norm.weight", dm.head_device), config.rms_eps, fused)
        self.head_device, self.head_group = torch.device(dm.head_device), dm.head_group
        self.embedding_group = dm.embedding_group
        rope_freqs = build.vector("rope_freqs.weight", "cpu") if "rope_freqs.weight" in weights else None
        self.freqs = rope_table(config, max_positions, rope_freqs).to(dm.embedding_device)
        self.weight_format = "quantized" if quantized else "dequantized"

    def _head(self, build: WeightBuilder, dm: DeviceMap):
        if not self.config.tied_output:
            return build.linear(["output.weight"], dm.head_device)
        embd = self.tok_embeddings      # tied: share the table where it can serve as the head too
        if embd.device == torch.device(dm.head_device) and (
                not isinstance(embd, Int8Weight) or int8_backend(embd.device.type)):
            return embd
        return build.linear(["token_embd.weight"], dm.head_device)

    @staticmethod
    def cross(x: torch.Tensor, freqs: torch.Tensor, device: torch.device):
        """Move the activations (and the rotary table rows) to the next device group's device."""
        return x.to(device, non_blocking=True), freqs.to(device, non_blocking=True)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                logits_rows: torch.Tensor | None = None, decode_rows: int = 0,
                paged: PagedRows | None = None) -> torch.Tensor:
        """tokens, positions (T,) -> float32 logits (len(logits_rows) or T, V).
        decode_rows: the leading rows that are decode or verify rows (one query each): the
        quantized weights compute them the same way whatever else is in the batch.
        paged: those rows' attention metadata, when the KV pool allows the paged kernel."""
        x = self.tok_embeddings.rows(tokens).to(self.dtype)                   # (T, D)
        freqs = self.freqs[positions]                                        # (T, hd/2)
        group = self.embedding_group
        for layer in self.layers:
            if layer.group != group:
                x, freqs = self.cross(x, freqs, layer.device)
                group = layer.group
            x = layer(x, freqs, segments, decode_rows, paged)
        if self.head_group != group:
            x, freqs = self.cross(x, freqs, self.head_device)
        if logits_rows is not None:
            x = x[logits_rows.to(x.device)]
        return self.output(self.norm(x), decode_rows).float()
