"""The model's hyper-parameters, read once from GGUF metadata into a frozen dataclass."""
from __future__ import annotations

from dataclasses import dataclass

from layerplan.gguf_header import GGUFFormatError, GGUFHeader, LongArray, shown
from layerplan.gguf_values import (DEFAULT_CONTEXT_LENGTH, REQUIRED, MAX_CONTEXT, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, arch_float,
                                   arch_int, arch_ints_per_layer, meta_int)
from layerplan.architectures import ARCHITECTURES, Architecture
from localrun.chat_template import check_template, family_template
from localrun.errors import UserError

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)   # llama.cpp writes Llama 2/3, Mistral and SmolLM2 as "llama"
MAX_ROPE_BASE = 1e12
MAX_ROPE_FACTOR = 1e6


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    n_layers: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_vocab: int
    context_length: int          # trained context
    rope_base: float
    rope_dim: int                # rotated dimensions per head (== head_dim for llama)
    rope_scaling_type: str       # "none" | "linear" | "yarn" (yarn read but treated as linear)
    rope_scaling_factor: float   # positions are divided by this for linear scaling
    rms_eps: float
    tied_output: bool            # no output.weight: the head reuses token_embd
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None    # as the file has it, else the family's turn format; None: built-in ChatML
    chat_template_origin: str = "file"   # "file", "family" (the file has none) or "none"
    sliding_window: int | None = None    # tokens a local layer attends over (itself included)
    local_layers: tuple[bool, ...] = ()  # per layer: attends over the sliding window only
    rope_base_local: float | None = None  # RoPE base of the local layers (else rope_base)
    attention_scale: float | None = None  # query scale, None: 1/sqrt(head_dim)
    final_logit_softcap: float | None = None  # logits = c * tanh(logits / c)

    @property
    def arch(self) -> Architecture:
        """The family's description (layerplan/architectures.py)."""
        return ARCHITECTURES[self.architecture]

    @property
    def num_local_layers(self) -> int:
        return sum(self.local_layers)

    def is_local(self, layer: int) -> bool:
        return bool(self.local_layers) and self.local_layers[layer]

    @property
    def chat_template_notice(self) -> str | None:
        """One sentence for the user when the file carries no chat template and the family's
        turn format stands in for it."""
        if self.chat_template_origin != "family":
            return None
        return (f"the model file carries no chat template; using {self.architecture}'s "
                f"{self.arch.chat_format} turn format")

    @property
    def chat_template_error(self) -> str | None:
        """Why the file's template is refused (one sentence; the built-in one is used then),
        None if it is usable. Checked on first use only, so `generate` never renders it."""
        return check_template(self.chat_template) if self.chat_template is not None else None

    @classmethod
    def from_header(cls, header: GGUFHeader, tensors: dict) -> "ModelConfig":
        """tensors: name -> TensorInfo of the same file. Every value the model divides by or
        allocates from is checked here (type, range, finiteness): one UserError sentence."""
        try:
            return cls._from_header(header, tensors)
        except GGUFFormatError as e:
            raise UserError(f"{header.path.name}: {e.detail}") from None

    @classmethod
    def _from_header(cls, header: GGUFHeader, tensors: dict) -> "ModelConfig":
        md, where = header.metadata, header.path.name
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"{where}: architecture '{shown(str(arch))}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        n_layers = arch_int(header, "block_count", low=1, high=MAX_LAYERS)
        n_embd = arch_int(header, "embedding_length", low=1, high=MAX_WIDTH)
        n_head = _same_in_every_layer(header, "attention.head_count", n_layers)
        n_head_kv = _same_in_every_layer(header, "attention.head_count_kv", n_layers, n_head)
        if n_head % n_head_kv:
            raise UserError(f"{where}: {n_head} heads are not a multiple of {n_head_kv} KV heads")
        if f"{arch}.attention.key_length" not in md and n_embd % n_head:
            raise UserError(f"{where}: {n_head} heads do not divide embedding width {n_embd}")
        head_dim = arch_int(header, "attention.key_length", n_embd // n_head, low=2, high=MAX_WIDTH)
        if arch_int(header, "attention.value_length", head_dim, low=1, high=MAX_WIDTH) != head_dim:
            raise UserError(f"{where}: key and value heads of different widths are not supported")
        rope_dim = arch_int(header, "rope.dimension_count", head_dim, low=2, high=MAX_WIDTH)
        if rope_dim != head_dim:
            raise UserError(f"{where}: RoPE over {rope_dim} of {head_dim} head dimensions is not supported "
                            "(localrun's llama rotates whole heads)")
        embd = tensors.get("token_embd.weight")
        if embd is None:
            raise UserError(f"{where}: tensor 'token_embd.weight' is missing")
        if len(embd.shape) != 2:
            raise UserError(f"{where}: tensor 'token_embd.weight' has shape {list(embd.shape)}, not two dimensions")
        n_vocab = arch_int(header, "vocab_size", embd.shape[1], low=1, high=MAX_VOCAB)
        tokens = md.get("tokenizer.ggml.tokens")
        if isinstance(tokens, (list, LongArray)) and len(tokens) != n_vocab:
            raise UserError(f"{where}: the vocabulary lists {len(tokens):,} tokens for {n_vocab:,} embedding rows")
        scaling = md.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear", "yarn"):
            raise UserError(f"{where}: rope scaling type '{shown(str(scaling))}' is not supported")
        factor = 1.0
        if scaling != "none" and md.get(f"{arch}.rope.scaling.factor") != 0:   # 0: converters' "unset"
            factor = arch_float(header, "rope.scaling.factor", 1.0, low=0.0, high=MAX_ROPE_FACTOR)
        template = md.get("tokenizer.chat_template")
        family = ARCHITECTURES[arch]
        origin = "file" if isinstance(template, str) else "none"
        if origin == "none" and family_template(family.chat_format) is not None:
            template, origin = family_template(family.chat_format), "family"
        window = arch_int(header, "attention.sliding_window", 0, low=0, high=MAX_CONTEXT) if family.swa_pattern else 0
        if f"{arch}.attention.sliding_window" in md and not family.swa_pattern:
            raise UserError(f"{where}: '{arch}.attention.sliding_window' is set, and localrun runs {arch} "
                            "with full attention in every layer (a Mistral-style sliding window is not supported)")
        local_layers = tuple(family.is_local_layer(i, window) for i in range(n_layers))
        softcap = (arch_float(header, "final_logit_softcapping", 1.0, low=0.0, high=1e6)
                   if f"{arch}.final_logit_softcapping" in md else None)
        attention_scale = None
        if arch == "gemma3" and n_layers == 62:      # Gemma 3 27B: llama.cpp's query_pre_attn_scalar
            attention_scale = (n_embd / n_head) ** -0.5
        return cls(
            architecture=arch,
            name=str(md.get("general.name", header.path.stem)),
            n_layers=n_layers,
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=_same_in_every_layer(header, "feed_forward_length", n_layers),
            n_vocab=n_vocab,
            context_length=arch_int(header, "context_length", DEFAULT_CONTEXT_LENGTH, low=1, high=MAX_CONTEXT),
            rope_base=arch_float(header, "rope.freq_base", 10000.0, low=1.0, high=MAX_ROPE_BASE),
            rope_dim=rope_dim,
            rope_scaling_type=scaling,
            rope_scaling_factor=factor,
            rms_eps=arch_float(header, "attention.layer_norm_rms_epsilon", family.default_rms_eps, low=0.0, high=1.0),
            tied_output="output.weight" not in tensors,
            bos_token_id=_token_id(header, "tokenizer.ggml.bos_token_id", n_vocab),
            eos_token_id=_token_id(header, "tokenizer.ggml.eos_token_id", n_vocab),
            add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", True)),
            chat_template=template if isinstance(template, str) else None,
            chat_template_origin=origin,
            sliding_window=window or None,
            local_layers=local_layers if any(local_layers) else (),
            rope_base_local=family.local_rope_base if any(local_layers) else None,
            attention_scale=attention_scale,
            final_logit_softcap=softcap or None,
        )


def _same_in_every_layer(header: GGUFHeader, key: str, n_layers: int, default=REQUIRED) -> int:
    """A count stored once or per layer (as some families store head counts); localrun's llama
    needs one value for every layer."""
    values = arch_ints_per_layer(header, key, n_layers, default, low=1, high=MAX_HEADS if "head" in key else MAX_WIDTH)
    if len(set(values)) > 1:
        raise GGUFFormatError(f"'{header.architecture}.{key}' differs between layers ({', '.join(map(str, values[:8]))}"
                              f"{', ...' if len(values) > 8 else ''}), which localrun's llama model does not support")
    return values[0]


def _token_id(header: GGUFHeader, key: str, n_vocab: int) -> int | None:
    return meta_int(header, key, high=n_vocab - 1) if key in header.metadata else None
