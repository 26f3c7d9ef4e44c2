"""Model families: one small description per GGUF `general.architecture`, as llama.cpp builds it.

Torch-free, so both the planner (layerplan/model_profile.py: which layers keep a sliding
window) and localrun (the loader, the config and the model) read the same facts: the
hyperparameter defaults, which tensors each layer holds, and the norm, activation and RoPE
variants. Adding a family means one `Architecture(...)` entry here plus the model code for any
variant it introduces (localrun/model/llama.py reads these flags) and tests.

Facts are llama.cpp's (src/llama-model.cpp, src/models/*.cpp, convert_hf_to_gguf.py):
- llama: RoPE over adjacent pairs (LLAMA_ROPE_TYPE_NORM; the converter permutes Q/K rows),
  SwiGLU FFN, pre-norms only.
- qwen2: Q/K/V biases, RoPE over the two halves of each head (NEOX), head tied or not.
- qwen3: RMSNorm of each Q and K head before RoPE (`attn_q_norm`, `attn_k_norm`), NEOX RoPE, no
  biases; head_dim from `attention.key_length` (n_head x head_dim may differ from n_embd).
- gemma3: embeddings scaled by sqrt(n_embd); RMSNorm before and after attention and FFN; Q/K
  norms; GELU(tanh)-gated FFN; NEOX RoPE; 5 of every 6 layers (il % 6 < 5) attend over a
  sliding window of `attention.sliding_window` tokens with RoPE base 10,000, the others over the
  whole context with `rope.freq_base`. The converter stores Gemma's norm weights as 1 + w, so
  they multiply as stored, as in every other family.
"""
from __future__ import annotations

from dataclasses import dataclass

BASE_LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                      "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")


@dataclass(frozen=True)
class Architecture:
    name: str                          # general.architecture
    description: str                   # for `localrun info --families`
    rope_type: str = "normal"          # "normal": adjacent pairs (x[2i], x[2i+1]); "neox": (x[i], x[i + hd/2])
    attention_bias: bool = False       # attn_q/k/v.bias
    qk_norm: bool = False              # attn_q_norm, attn_k_norm: RMSNorm over each head (head_dim,)
    post_norms: bool = False           # post_attention_norm, post_ffw_norm after attention and FFN
    embedding_scale: bool = False      # x = embedding * sqrt(n_embd)
    activation: str = "silu"           # gated FFN: act(gate) * up, "silu" or "gelu_tanh"
    swa_pattern: int | None = None     # n: layer il uses the sliding window when il % n < n - 1
    local_rope_base: float | None = None   # RoPE base of the sliding-window layers
    default_rms_eps: float = 1e-5
    chat_format: str | None = None     # turn format used when the file carries no chat template

    def layer_tensors(self) -> tuple[str, ...]:
        """Names (without '.weight') of every tensor one layer holds."""
        names = list(BASE_LAYER_TENSORS)
        if self.qk_norm:
            names += ["attn_q_norm", "attn_k_norm"]
        if self.post_norms:
            names += ["post_attention_norm", "post_ffw_norm"]
        return tuple(names)

    def bias_tensors(self) -> tuple[str, ...]:
        """Names (without '.bias') of the layer's bias vectors."""
        return ("attn_q", "attn_k", "attn_v") if self.attention_bias else ()

    def layer_shapes(self, *, n_embd: int, n_head: int, n_head_kv: int, head_dim: int,
                     n_ff: int) -> dict[str, tuple[int, ...]]:
        """Each layer tensor's shape in GGUF order (row length first), keyed by its full suffix
        ('attn_q.weight', 'attn_q.bias')."""
        q, kv = n_head * head_dim, n_head_kv * head_dim
        shapes = {"attn_norm": (n_embd,), "attn_q": (n_embd, q), "attn_k": (n_embd, kv), "attn_v": (n_embd, kv),
                  "attn_output": (q, n_embd), "ffn_norm": (n_embd,), "ffn_gate": (n_embd, n_ff),
                  "ffn_up": (n_embd, n_ff), "ffn_down": (n_ff, n_embd),
                  "attn_q_norm": (head_dim,), "attn_k_norm": (head_dim,),
                  "post_attention_norm": (n_embd,), "post_ffw_norm": (n_embd,)}
        out = {f"{name}.weight": shapes[name] for name in self.layer_tensors()}
        bias = {"attn_q": (q,), "attn_k": (kv,), "attn_v": (kv,)}
        out.update({f"{name}.bias": bias[name] for name in self.bias_tensors()})
        return out

    def is_local_layer(self, layer: int, sliding_window: int | None) -> bool:
        """Whether layer attends over the sliding window only."""
        return bool(sliding_window) and self.swa_pattern is not None and layer % self.swa_pattern < self.swa_pattern - 1


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("llama", "Llama 2/3, Mistral, SmolLM2 (SwiGLU, RoPE on adjacent pairs)"),
    Architecture("qwen2", "Qwen 2 / 2.5 (Q/K/V biases, NEOX RoPE)", rope_type="neox", attention_bias=True,
                 default_rms_eps=1e-6, chat_format="chatml"),
    Architecture("qwen3", "Qwen 3 dense (Q/K head norms, NEOX RoPE)", rope_type="neox", qk_norm=True,
                 default_rms_eps=1e-6, chat_format="chatml"),
    Architecture("gemma3", "Gemma 3 text (sqrt(d) embeddings, pre+post norms, Q/K norms, GELU-tanh, "
                 "5 sliding-window layers per global one)", rope_type="neox", qk_norm=True, post_norms=True,
                 embedding_scale=True, activation="gelu_tanh", swa_pattern=6, local_rope_base=10000.0,
                 default_rms_eps=1e-6, chat_format="gemma"),
)}

# families the planner profiles but localrun does not run: their sliding-window pattern only
PLANNER_SWA_PATTERNS = {"gemma2": 2, "cohere2": 4}


def swa_pattern(architecture: str) -> int | None:
    """Sliding-window layer pattern of a family (see Architecture.swa_pattern), None if it has none."""
    arch = ARCHITECTURES.get(architecture)
    return arch.swa_pattern if arch is not None else PLANNER_SWA_PATTERNS.get(architecture)
