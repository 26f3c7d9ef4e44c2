"""The decoder-only transformer of every supported family (llama, qwen2, qwen3, gemma3) as
llama.cpp lays out its GGUF. A family's variants are flags of its `Architecture`
(layerplan/architectures.py): Q/K/V biases, Q/K head norms, post-norms, the embedding scale,
the FFN activation, the RoPE pairing, and sliding-window (local) layers with their own RoPE base.

Transformer -> Block -> Attention / FeedForward, gpt-fast style, with fused QKV and gate/up
weights. One forward runs a flat batch of T tokens that may belong to several sequences:
the matmuls see all T tokens at once, attention runs per sequence segment on its KV cache.

Weights are callables `w(x) == x @ W.T` (localrun/model/quant.py): dense tensors on the
reference path, int4/int8 codes for torch's weight-only kernels on the fast path. Each layer
sits on the device its `DeviceMap` names (localrun/placement.py); the activations move to the
next device once, where the device group changes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from localrun import kernels
from localrun.config import ModelConfig
from localrun.model.fused_block import FusedDecode, FusedStack
from localrun.model.gguf_weight import WeightMath
from localrun.model.quant import FileTensor, Int8Weight, PlainWeight, int8_backend, make_embedding, make_weight
from localrun.placement import DeviceMap, all_on

WINDOW_QUERY_BLOCK = 256    # prompt rows per masked SDPA in a sliding-window layer (Attention._attend_window)


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
    window_caches: dict | None = None   # local layer -> cache holding the last `window` positions only
    shared: "SharedPrefix | None" = None   # cached positions this segment shares with others of the batch
    prompt: bool = False   # a prompt chunk of the engine: even one row attends as prompt rows do (prompt_kernel)


@dataclass(eq=False)
class SharedPrefix:
    """Positions 0..num_tokens-1 (whole blocks), held by the same blocks in the tables of several
    prompt chunks of one batch (a prefix-cache hit they all took): attended once for all their
    rows (cascade attention), not gathered and attended again per sequence. The segments of one
    group hold the same SharedPrefix object."""
    num_tokens: int


@dataclass
class PagedRows:
    """The leading rows of a batch that are attended one query each over its own prefix: decode
    and verify rows, and short prompt chunks after them (model_runner.num_paged_entries), in one
    kernel call per layer straight from the KV pool (float32, float16, bfloat16, or int8/fp8
    with their scales) (localrun::paged_attention), with no gather and no loop over sequences.
    Built once per forward by the model runner, which then passes segments for the later rows only."""
    num_rows: int
    slots: torch.Tensor           # (T,) where each row's K/V is written
    block_tables: torch.Tensor    # (S, max_blocks) int64, padded
    row_seq: torch.Tensor         # (T,) the row's sequence: a row of block_tables
    row_len: torch.Tensor         # (T,) keys the row sees: its position + 1
    block_size: int
    pools: object                 # layer -> (k_pool, v_pool), each (num_blocks * block_size, n_kv, hd)
    local_slots: torch.Tensor | None = None         # (T,) the same in the local layers' pool, if it has one
    local_block_tables: torch.Tensor | None = None  # (S, max_blocks) local tables, padded (-1: freed)
    # quantized pools (int8, fp8): layer -> (k_scale, v_scale), written by the kernel with the rows
    scales: object = None


def rope_table(config: ModelConfig, max_positions: int, rope_freqs: torch.Tensor | None,
               local: bool = False) -> torch.Tensor:
    """cos + i sin of position * theta_i, (max_positions, rope_dim/2) complex64.
    local: the table of the sliding-window layers (their own base, no scaling, as llama.cpp's
    rope_freq_base_train_swa)."""
    dim = config.rope_dim
    base = config.rope_base_local if local else config.rope_base
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if rope_freqs is not None and not local:    # Llama 3.x long-context frequency factors
        inv_freq = inv_freq / rope_freqs.double()
    positions = torch.arange(max_positions, dtype=torch.float64) / (1.0 if local else config.rope_scaling_factor)
    angles = torch.outer(positions, inv_freq)
    return torch.polar(torch.ones_like(angles), angles).to(torch.complex64)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor, neox: bool = False) -> torch.Tensor:
    """x (T, H, hd), freqs (T, hd/2) complex -> x rotated, same dtype.
    llama.cpp's "normal" RoPE rotates adjacent pairs (x[2i], x[2i+1]) (the GGUF converter
    permutes llama's Q/K rows to match); "neox" (qwen2, qwen3, gemma3) rotates (x[i], x[i+hd/2])."""
    if x.dtype != torch.float32:
        return apply_rope(x.float(), freqs, neox).to(x.dtype)
    if neox:                                                            # halves -> pairs and back
        halves = x.unflatten(-1, (2, -1)).transpose(-1, -2).contiguous()   # (T, H, hd/2, 2)
        rotated = torch.view_as_real(torch.view_as_complex(halves) * freqs[:, None, :])
        return rotated.transpose(-1, -2).flatten(-2)
    pairs = torch.view_as_complex(x.unflatten(-1, (-1, 2)))             # (T, H, hd/2)
    return torch.view_as_real(pairs * freqs[:, None, :]).flatten(-2)


def apply_rope_fused(x: torch.Tensor, freqs: torch.Tensor, neox: bool = False) -> torch.Tensor:
    """apply_rope in one compiled call (localrun::rope) for float32 on the CPU; the same products,
    each rounded before its sum, as the complex product above (tests/test_kernels.py)."""
    if x.dtype != torch.float32 or x.device.type != "cpu":
        return apply_rope(x, freqs, neox)
    return torch.ops.localrun.rope(x, freqs, neox)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, fused: bool = False):
        super().__init__()
        self.weight, self.eps = weight, eps        # weight float32 (D,)
        self.fused = fused and weight.device.type == "cpu"     # localrun's one-call kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.dtype == torch.float32 and x.dim() == 2:
            return torch.ops.localrun.rms_norm(x, self.weight, self.eps)
        if self.fused and x.dtype == torch.float32 and x.dim() == 3:     # per-head Q/K norms: (T, H, hd)
            return torch.ops.localrun.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(x.shape)
        if x.dtype != torch.float32:                                     # normalize in float32
            return F.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, wqkv, wo, layer: int, bias: torch.Tensor | None = None,
                 q_norm: "RMSNorm | None" = None, k_norm: "RMSNorm | None" = None, fused: bool = False,
                 prompt_kernel: str | None = None):
        super().__init__()
        self.rope = apply_rope_fused if fused else apply_rope      # the kernels' RoPE, or torch's
        self.wqkv, self.wo, self.layer = wqkv, wo, layer   # (q+2kv dims, D), (D, q dims)
        self.bias = bias                                   # (q+2kv dims,) or None (qwen2's Q/K/V biases)
        self.q_norm, self.k_norm = q_norm, k_norm          # RMSNorm over each head (qwen3, gemma3)
        self.n_head, self.n_head_kv, self.head_dim = config.n_head, config.n_head_kv, config.head_dim
        self.neox = config.arch.rope_type == "neox"
        self.window = config.sliding_window if config.is_local(layer) else None   # None: whole context
        self.scale = config.attention_scale                # None: 1/sqrt(head_dim)
        # prompt rows' attention through localrun's kernel instead of torch's float32 flash
        # attention, with prompt_math "int8" (Block): "bf16" (kernels.attention_bf16: bfloat16
        # products, float32 sums; AVX-512 BF16) or "f32" (kernels.attention_f32: float32, AVX2)
        step = 64 if prompt_kernel == "bf16" else 16
        self.prompt_kernel = prompt_kernel if self.head_dim % step == 0 and self.head_dim <= 256 else None

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, segments: list[Segment], decode_rows: int = 0,
                paged: PagedRows | None = None) -> torch.Tensor:
        T, H, n_kv = x.shape[0], self.n_head, self.n_head_kv
        qkv = self.wqkv(x, decode_rows)                                   # (T, H*hd + 2 n_kv*hd)
        if self.bias is not None:
            qkv = qkv + self.bias
        qkv = qkv.view(T, H + 2 * n_kv, self.head_dim)                    # (T, H + 2 n_kv, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(qkv[:, :H]), self.k_norm(qkv[:, H:H + n_kv])
            q, k = self.rope(torch.cat([q, k], dim=1), freqs, self.neox).split([H, n_kv], dim=1)
        else:
            q, k = self.rope(qkv[:, :H + n_kv], freqs, self.neox).split([H, n_kv], dim=1)  # rotated at once
        if self.scale is not None:        # fold a non-default query scale into q: sdpa divides by sqrt(hd)
            q = q * (self.scale * self.head_dim ** 0.5)
        v = qkv[:, H + n_kv:]                                             # (T, n_kv, hd)
        if paged is not None:
            n = paged.num_rows
            k_pool, v_pool = paged.pools(self.layer)
            slots, tables = paged.slots, paged.block_tables
            if self.window is not None and paged.local_slots is not None:     # the local layers' pool
                slots, tables = paged.local_slots, paged.local_block_tables
            k_scale, v_scale = paged.scales(self.layer) if paged.scales is not None else (None, None)
            out = torch.ops.localrun.paged_attention(q[:n], k[:n], v[:n], k_pool, v_pool, slots, tables,
                                                      paged.row_seq, paged.row_len, paged.block_size,
                                                      self.window or 0, k_scale, v_scale)   # (n, H, hd)
            if segments:            # the prompt chunks after those rows
                out = torch.cat([out] + self._attend_segments(q, k, v, segments))
        elif len(segments) == 1:
            out = self._attend(q, k, v, segments[0])
        else:
            out = torch.cat(self._attend_segments(q, k, v, segments))
        return self.wo(out.reshape(T, H * self.head_dim), decode_rows)

    def _attend_segments(self, q, k, v, segments: list[Segment]) -> list[torch.Tensor]:
        """Each segment's attention output (t, H, hd), in order; the segments of a shared prefix
        together (cascade attention, CPU, whole-context layers), the others one by one."""
        outs: dict[int, torch.Tensor] = {}
        groups: dict[int, list[int]] = {}
        for i, s in enumerate(segments):
            if s.shared is not None and self.window is None and q.device.type == "cpu":
                groups.setdefault(id(s.shared), []).append(i)
            else:
                outs[i] = self._attend(q[s.start:s.start + s.length], k[s.start:s.start + s.length],
                                       v[s.start:s.start + s.length], s)
        for members in groups.values():
            group = [segments[i] for i in members]
            for i, out in zip(members, self._attend_shared(q, k, v, group)):
                outs[i] = out
        return [outs[i] for i in range(len(segments))]

    def _attend_shared(self, q, k, v, segments: list[Segment]) -> list[torch.Tensor]:
        """Cascade attention: the rows of all `segments` over their shared cached prefix (keys
        0..C-1) in one call, each segment's rows over its own keys C.. in another, merged by
        their log-sum-exps. Softmax over the union of two key sets is the two partial softmaxes
        weighted by e^lse each, so the result is the masked attention of `_attend` (to float32
        rounding) without gathering the prefix once per sequence. With the prompt kernel,
        `_kernel_attend_shared` instead: exactly the bits of `_attend`."""
        G, C = self.n_head // self.n_head_kv, segments[0].shared.num_tokens
        rows = torch.cat([q[s.start:s.start + s.length] for s in segments])          # (R, H, hd)
        if self._kernel(q):
            return self._kernel_attend_shared(q, k, v, rows, segments)
        k_pre, v_pre = segments[0].cache.read(self.layer, C)                          # (n_kv, C, hd)
        o_pre, lse_pre = attend_unmasked(rows, k_pre, v_pre)
        o_own, lse_own = [], []
        for s in segments:
            rows_s = slice(s.start, s.start + s.length)
            k_s, v_s = s.cache.update(self.layer, s.cache_start, k[rows_s], v[rows_s], first=C)  # (n_kv, L - C, hd)
            t, n = s.length, k_s.shape[1]
            # query i (position cache_start + i) sees keys up to n - t + i: -inf above that
            mask = None if n == t else torch.full((t, n), float("-inf"), dtype=q.dtype, device=q.device).triu(n - t + 1)
            o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q[rows_s].transpose(0, 1)[None], k_s.repeat_interleave(G, 0)[None], v_s.repeat_interleave(G, 0)[None],
                is_causal=mask is None, attn_mask=mask)
            o_own.append(o[0].transpose(0, 1))                                        # (t, H, hd)
            lse_own.append(lse[0].transpose(0, 1))                                    # (t, H)
        out = merge_by_lse(o_pre, lse_pre, torch.cat(o_own), torch.cat(lse_own))
        return list(out.to(q.dtype).split([s.length for s in segments]))

    def _kernel_attend_pool(self, q, keys) -> torch.Tensor:
        """The prompt kernel's attention of queries (t, H, hd) at the last t positions of `keys`
        (paged_kv.PoolKeys) over them where they lie in the pool: what `_attend_causal` and
        `_attend_window` compute with the kernel over the gathered keys, the same bits."""
        t, end = q.shape[0], keys.first + keys.num_tokens
        first, window = keys.first, 0
        if self.window is not None:   # the keys from the first one a query sees; a window where one is cut
            first = max(keys.first, end - t - self.window + 1)
            window = 0 if end - self.window <= first else self.window
        out, _ = kernels.attention_paged(self.prompt_kernel, q, keys, first - keys.first, end - first, end - t - first,
                                         self.head_dim ** -0.5, window, first % kernels.PROMPT_KEY_BLOCK)
        return out

    def _kernel_attend_shared(self, q, k, v, rows, segments: list[Segment]) -> list[torch.Tensor]:
        """The prompt kernel's cascade: the first S cached keys (S the shared prefix down to a
        multiple of the kernel's key block and of the block size) packed once for every
        segment's rows, then each segment's keys from S on; every row gets the bits of
        `_attend` alone (the kernel walks the same key blocks), whatever else shared the step."""
        step = math.lcm(kernels.PROMPT_KEY_BLOCK, segments[0].cache.cache.block_size)
        S = segments[0].shared.num_tokens // step * step
        if S == 0:
            return [self._attend(q[s.start:s.start + s.length], k[s.start:s.start + s.length],
                                 v[s.start:s.start + s.length], s) for s in segments]
        lengths = [s.length for s in segments]
        # the keys where they lie in the paged pool (segments share a prefix only there; a CPU
        # pool of any KV type is read in place)
        own = [s.cache.update_in_pool(self.layer, s.cache_start, k[s.start:s.start + s.length],
                                      v[s.start:s.start + s.length], first=S) for s in segments]
        out = kernels.attention_shared_paged(self.prompt_kernel, rows, segments[0].cache.pool_keys(self.layer, S),
                                             own, lengths, self.head_dim ** -0.5)
        return list(out.to(q.dtype).split(lengths))

    def _attend_after_cached(self, q, k_all, v_all) -> torch.Tensor:
        """Queries (t, H, hd) at the last t positions of L keys: every query sees all C = L - t
        cached keys, and its own chunk causally. Two flash calls (the cached keys unmasked, with
        the grouped query heads folded into rows; the chunk's own keys causal) merged by their
        log-sum-exps, instead of one SDPA with an explicit (t, L) mask, which takes the slower
        masked path. The same softmax (to float32 rounding)."""
        G, C = self.n_head // self.n_head_kv, k_all.shape[1] - q.shape[0]
        if self._kernel(q):           # one call: query i sees keys 0 .. C + i
            return self._kernel_attend(q, k_all, v_all, C)[0]
        o_pre, lse_pre = attend_unmasked(q, k_all[:, :C], v_all[:, :C])
        k_own, v_own = k_all[:, C:], v_all[:, C:]
        if G > 1:
            k_own, v_own = k_own.repeat_interleave(G, 0), v_own.repeat_interleave(G, 0)
        o_own, lse_own = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.transpose(0, 1)[None], k_own[None], v_own[None], is_causal=True)
        return merge_by_lse(o_pre, lse_pre, o_own[0].transpose(0, 1), lse_own[0].transpose(0, 1)).to(q.dtype)

    def _attend(self, q, k, v, seg: Segment) -> torch.Tensor:
        """Causal attention of one segment's queries over its cached prefix plus itself (over
        the last `window` positions only, itself included, in a local layer)."""
        t = q.shape[0]
        if self._kernel(q) and not seg.rowwise and (t > 1 or seg.prompt) and hasattr(seg.cache, "update_in_pool"):
            keys = seg.cache.update_in_pool(self.layer, seg.cache_start, k, v)
            if keys is not None:      # the prompt kernel reads the keys where they lie in the pool
                return self._kernel_attend_pool(q, keys)
        k_all, v_all = seg.cache.update(self.layer, seg.cache_start, k, v)   # (n_kv, L, hd)
        L = k_all.shape[1]
        if self.window is not None:   # a paged local layer returns the keys from its window's first block on
            return self._attend_window(q, k_all, v_all, seg.rowwise, seg.cache_start + t - L, seg.prompt)
        if seg.rowwise and t > 1:     # row i: one query over keys 0..L-t+i, as a decode step
            return torch.cat([sdpa(q[i:i + 1], k_all[:, :L - t + i + 1], v_all[:, :L - t + i + 1])
                              for i in range(t)])
        return self._attend_causal(q, k_all, v_all, seg.prompt)

    def _attend_causal(self, q, k_all, v_all, prompt: bool = False, start: int = 0) -> torch.Tensor:
        """Queries (t, H, hd) at the last t of the L positions of k_all, v_all (n_kv, L, hd),
        query i over keys 0..L-t+i. prompt: the rows of an engine's prompt chunk, which take the
        prompt kernel even when there is one of them (a prompt's tail after a prefix hit), so that
        a prompt row rounds alike whatever chunk it falls in. start: the position of k_all[:, 0]."""
        t, L = q.shape[0], k_all.shape[1]
        mask, causal = None, False
        if (t > 1 or prompt) and self._kernel(q):
            return self._kernel_attend(q, k_all, v_all, L - t, start=start)[0]
        if t > 1 and L == t:
            causal = True
        elif t > 1 and q.device.type == "cpu":
            return self._attend_after_cached(q, k_all, v_all)
        elif t > 1:   # new tokens are the last t of L: query i sees keys 0..L-t+i
            mask = torch.ones(t, L, dtype=torch.bool, device=q.device).tril(L - t)
        return sdpa(q, k_all, v_all, mask, causal)

    def _kernel(self, q: torch.Tensor) -> bool:
        return self.prompt_kernel is not None and q.dtype == torch.float32 and q.device.type == "cpu"

    def _kernel_attend(self, q, k, v, offset: int, window: int = 0, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries (t, H, hd) over keys and values (n_kv, L, hd), query i over keys 0 .. offset + i
        (offset < 0: all; window > 0: the last `window` of them): (output (t, H, hd), log-sum-exp
        (t, H)), float32 sums (kernels.attention_bf16 over bfloat16 products, or attention_f32).
        start: the position of key 0, which places the keys on the kernel's grid of key blocks
        (a row's bits then do not depend on where k starts). The scale is sdpa's: a custom one
        is folded into q."""
        attend = kernels.attention_bf16 if self.prompt_kernel == "bf16" else kernels.attention_f32
        return attend(q, k.float(), v.float(), offset, self.head_dim ** -0.5, window, start % kernels.PROMPT_KEY_BLOCK)

    def _attend_window(self, q, k_all, v_all, rowwise: bool, offset: int = 0, prompt: bool = False) -> torch.Tensor:
        """Query i (position P-t+i, P = offset + L) over keys p with P-t+i - window < p <= P-t+i
        (llama.cpp's LLAMA_SWA_TYPE_STANDARD mask); k_all holds positions offset..P-1."""
        t, w = q.shape[0], self.window
        end = offset + k_all.shape[1]                                        # P
        first = max(offset, end - t - w + 1)                                 # no query reads before it
        k_all, v_all = k_all[:, first - offset:], v_all[:, first - offset:]  # (n_kv, P - first, hd)
        if rowwise or (t == 1 and not (prompt and self._kernel(q))):   # row i: one query over its window, as a decode step
            rows = []
            for i in range(t):
                p = end - t + i
                lo, hi = max(first, p - w + 1) - first, p + 1 - first
                rows.append(sdpa(q[i:i + 1], k_all[:, lo:hi], v_all[:, lo:hi]))
            return torch.cat(rows)
        if end - w <= first:      # every query sees every key from `first` on: plain causal attention
            return self._attend_causal(q, k_all, v_all, prompt, start=first)
        if self._kernel(q):       # one call: key j is position first + j; query i sees its window of them
            return self._kernel_attend(q, k_all, v_all, end - t - first, w, start=first)[0]
        # Queries in blocks of WINDOW_QUERY_BLOCK rows, each over the keys its rows can see (the
        # block's window: block + w - 1 keys), not the whole chunk's: one masked SDPA over the
        # chunk would compute t x (t + w - 1) scores for t x w that count (5x at t = 2048, w = 512).
        out = []
        for i0 in range(0, t, WINDOW_QUERY_BLOCK):
            i1 = min(t, i0 + WINDOW_QUERY_BLOCK)
            lo = max(first, end - t + i0 - w + 1)                            # the block's first key
            hi = end - t + i1                                                # one past its last key
            q_pos = torch.arange(end - t + i0, end - t + i1, device=q.device)[:, None]
            k_pos = torch.arange(lo, hi, device=q.device)[None, :]
            mask = (k_pos <= q_pos) & (q_pos - k_pos < w)                   # (i1 - i0, hi - lo)
            out.append(sdpa(q[i0:i1], k_all[:, lo - first:hi - first], v_all[:, lo - first:hi - first], mask))
        return torch.cat(out) if len(out) > 1 else out[0]


def attend_unmasked(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Query rows (R, H, hd) over every key (n_kv, C, hd), no mask, in one flash call: the
    output (R, H, hd) and log-sum-exp (R, H). Grouped query heads fold into rows: head
    h = g * G + j reads KV head g, and no mask ties a row to its position, so all R * G rows of
    KV head g attend in one batch entry."""
    R, H, hd = rows.shape
    n_kv = k.shape[0]
    G = H // n_kv
    folded = rows.reshape(R, n_kv, G, hd).permute(1, 2, 0, 3).reshape(1, n_kv, G * R, hd)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(folded, k[None], v[None])
    return (o.reshape(n_kv, G, R, hd).permute(2, 0, 1, 3).reshape(R, H, hd),
            lse.reshape(n_kv, G, R).permute(2, 0, 1).reshape(R, H))


def merge_by_lse(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two key sets from each set's output (t, H, hd) and
    log-sum-exp (t, H): the two partial softmaxes weighted by e^lse each, in float32."""
    top = torch.maximum(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - top)[..., None], torch.exp(lse_b - top)[..., None]
    return (o_a.float() * w_a + o_b.float() * w_b) / (w_a + w_b)


def sdpa(q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, mask: torch.Tensor | None = None,
         causal: bool = False) -> torch.Tensor:
    """Queries (t, H, hd) over keys and values (n_kv, L, hd) -> (t, H, hd), grouped-query."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_all[None], v_all[None],
                                         attn_mask=mask, is_causal=causal, enable_gqa=True)
    return out[0].transpose(0, 1)


class FeedForward(nn.Module):
    def __init__(self, w13, w2, fused: bool = False, activation: str = "silu"):
        super().__init__()
        self.w13, self.w2 = w13, w2        # (2*F, D) gate then up, (D, F)
        self.activation = activation       # "silu" (SwiGLU) or "gelu_tanh" (GeGLU, gemma)
        self.fused = fused                 # localrun::silu_mul / gelu_mul

    def forward(self, x: torch.Tensor, decode_rows: int = 0) -> torch.Tensor:
        gate_up = self.w13(x, decode_rows)                                   # (T, 2F)
        if self.fused and gate_up.dtype == torch.float32 and gate_up.device.type == "cpu":
            act = torch.ops.localrun.gelu_mul if self.activation == "gelu_tanh" else torch.ops.localrun.silu_mul
            return self.w2(act(gate_up), decode_rows)
        gate, up = gate_up.chunk(2, dim=-1)
        if self.activation == "gelu_tanh":
            return self.w2(F.gelu(gate, approximate="tanh").mul_(up), decode_rows)
        return self.w2(F.silu(gate).mul_(up), decode_rows)


class WeightBuilder:
    """Builds the model's weights on their devices, from dequantized tensors (`load_weights`,
    the reference) or from the file's tensors (`file_weights`), kept quantized if `quantized`."""

    def __init__(self, weights: dict, dtype: torch.dtype, quantized: bool, math: WeightMath = WeightMath()):
        self.weights, self.dtype, self.quantized, self.math = weights, dtype, quantized, math

    def linear(self, names: list[str], device: str):
        parts = [self.weights[n] for n in names]
        if isinstance(parts[0], FileTensor):
            return make_weight(parts, torch.device(device), self.dtype, self.quantized, self.math)
        return PlainWeight(torch.cat(parts).to(device=device, dtype=self.dtype))

    def embedding(self, name: str, device: str):
        t = self.weights[name]
        if isinstance(t, FileTensor):
            return make_embedding(t, torch.device(device), self.dtype, self.quantized, self.math)
        return PlainWeight(t.to(device=device, dtype=self.dtype))

    def bias(self, names: list[str], device: str) -> torch.Tensor | None:
        """The fused parts' biases, concatenated (float32), or None where the file has none."""
        if not all(n in self.weights for n in names):
            return None
        return torch.cat([self.vector(n, device) for n in names])

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
        arch, eps = config.arch, config.rms_eps

        def norm(name: str) -> RMSNorm:
            return RMSNorm(build.vector(p + name + ".weight", device), eps, self.fused)

        self.is_local = config.is_local(layer)               # sliding-window layer: its own RoPE table
        self.attention_norm = norm("attn_norm")
        bias = build.bias([p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"], device) \
            if arch.attention_bias else None
        q_norm, k_norm = (norm("attn_q_norm"), norm("attn_k_norm")) if arch.qk_norm else (None, None)
        # localrun's prompt attention where the prompt rows' products are 8-bit already (prompt_math
        # "int8" on a quantized weight): bfloat16 products where the CPU has them, their error lost
        # in the 8-bit activations' (SmolLM2's mean KL from the float64 model 2.98e-3 with it,
        # 3.44e-3 without; docs/kernels.md), else float32 on AVX2; "float32" math and float
        # weights keep torch's flash attention, the reference
        prompt_kernel = kernels.prompt_attention_kind() if self.fused and getattr(wqkv, "prompt_int8", False) else None
        self.attention = Attention(config, wqkv, build.linear([p + "attn_output.weight"], device), layer,
                                   bias, q_norm, k_norm, self.fused, prompt_kernel)
        self.ffn_norm = norm("ffn_norm")
        self.feed_forward = FeedForward(w13, build.linear([p + "ffn_down.weight"], device), self.fused,
                                        arch.activation)
        # gemma: RMSNorm of the attention and FFN outputs before each residual add
        self.post_attention_norm = norm("post_attention_norm") if arch.post_norms else None
        self.post_ffw_norm = norm("post_ffw_norm") if arch.post_norms else None
        self.fused_decode = FusedDecode.build(self)          # the decode step in one compiled call

    def forward(self, x, freqs, segments, decode_rows: int = 0, paged: PagedRows | None = None):
        freqs = freqs[1 if self.is_local else 0]                             # (T, hd/2)
        if self.fused_decode is not None and self.fused_decode.applies(x, segments, decode_rows, paged):
            return self.fused_decode(x, freqs, paged)                        # same ops as below, in C++
        attn = self.attention(self.attention_norm(x), freqs, segments, decode_rows, paged)
        if self.post_attention_norm is not None:
            attn = self.post_attention_norm(attn)
        if self.fused and attn.dtype == torch.float32:       # h = x + attn and its norm in one call
            h, normed = torch.ops.localrun.add_rms_norm(x, attn, self.ffn_norm.weight, self.ffn_norm.eps)
        else:
            h = x + attn
            normed = self.ffn_norm(h)
        ffn = self.feed_forward(normed, decode_rows)
        if self.post_ffw_norm is not None:
            ffn = self.post_ffw_norm(ffn)
        return h + ffn


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, weights: dict, *, max_positions: int,
                 device_map: DeviceMap | None = None, quantized: bool = False, dtype: torch.dtype | None = None,
                 math: WeightMath = WeightMath()):
        """weights: name -> tensor (load_weights: dequantized) or FileTensor (file_weights; held
        quantized where a kernel exists when `quantized`). dtype: the compute dtype. math: how
        in-place weights multiply rows (model/gguf_weight.py: WeightMath)."""
        super().__init__()
        self.config = config
        embd = weights["token_embd.weight"]
        self.dtype = dtype or (embd.dtype if isinstance(embd, torch.Tensor) else torch.float32)
        self.device_map = dm = device_map or all_on("cpu", config.n_layers)
        assert len(dm.layer_devices) == config.n_layers
        build = WeightBuilder(weights, self.dtype, quantized, math)
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
        tables = [rope_table(config, max_positions, rope_freqs)]
        if config.local_layers:
            tables.append(rope_table(config, max_positions, rope_freqs, local=True))
        self.rope_tables = torch.stack(tables).to(dm.embedding_device)   # (1 or 2: global, local; positions, hd/2)
        self.freqs = self.rope_tables[0]                                  # the global table: (positions, hd/2)
        self.embedding_scale = config.n_embd ** 0.5 if config.arch.embedding_scale else None
        self.weight_format = "quantized" if quantized else "dequantized"
        self.fused_steps, self.steps_of = None, None   # steps(), and the layers they were found for
        self.fused_stack = None                         # steps() as one call (FusedStack), where the kernels have it

    def steps(self):
        """Every block's decode step as one compiled call (FusedDecode) with its RoPE table, when
        every block has one and all run in the embedding's device group, else None: a decode step
        then calls them in a plain loop, with no module call and no Block.forward per layer (2% of
        SmolLM2's one-sequence step). Found again when `layers` is replaced (self_draft); setting
        `fused_steps` to None runs the blocks one by one. The steps are also bound into one call
        for all of them (`fused_stack`, FusedStack), which a decode step makes instead of the loop;
        setting it to None runs the loop."""
        if self.steps_of is not self.layers:
            steps = [(layer.fused_decode, 1 if layer.is_local else 0) for layer in self.layers]
            usable = all(f is not None and layer.group == self.embedding_group for (f, _), layer in zip(steps, self.layers))
            self.fused_steps, self.steps_of = (steps if usable else None), self.layers
            self.fused_stack = FusedStack.build(steps) if usable else None
        return self.fused_steps

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
        x = self.tok_embeddings.rows(tokens)                                 # (T, D)
        if self.embedding_scale is not None:                                 # gemma: in float32, as llama.cpp
            x = x.float() * self.embedding_scale
        x = x.to(self.dtype)
        freqs = self.rope_tables[:, positions]                               # (1 or 2, T, hd/2)
        group = self.embedding_group
        steps = self.steps()
        if steps is not None and steps[0][0].applies(x, segments, decode_rows, paged):
            # all in one call; eager only (torch.compile cannot trace its torchbind object: it traces the loop)
            if self.fused_stack is not None and not torch.compiler.is_compiling():
                x = self.fused_stack(x, freqs, paged)
            else:
                for step, table in steps:                                    # Block.forward's fused branch
                    x = step(x, freqs[table], paged)
        else:
            for layer in self.layers:
                if layer.group != group:
                    x, freqs = self.cross(x, freqs, layer.device)
                    group = layer.group
                x = layer(x, freqs, segments, decode_rows, paged)
        if self.head_group != group:
            x, freqs = self.cross(x, freqs, self.head_device)
        if logits_rows is not None:
            x = x[logits_rows.to(x.device)]
        logits = self.output(self.norm(x), decode_rows).float()
        if self.config.final_logit_softcap:
            cap = self.config.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits
