"""The model's hyper-parameters, read once from GGUF metadata into a frozen dataclass."""
from __future__ import annotations

from dataclasses import dataclass

from layerplan.gguf_header import GGUFHeader
from localrun.errors import UserError

SUPPORTED_ARCHITECTURES = ("llama",)   # llama.cpp writes Llama 2/3, Mistral and SmolLM2 as "llama"


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
    chat_template: str | None

    @property
    def n_rep(self) -> int:
        """Query heads per KV head (grouped-query attention)."""
        return self.n_head // self.n_head_kv

    @classmethod
    def from_header(cls, header: GGUFHeader, tensors: dict) -> "ModelConfig":
        """tensors: name -> TensorInfo of the same file."""
        md, where = header.metadata, header.path.name
        arch = md.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"{where}: architecture '{arch}' is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")

        def need(key):
            full = f"{arch}.{key}"
            if full not in md:
                raise UserError(f"{where}: metadata key '{full}' is missing")
            return md[full]

        n_embd, n_head = int(need("embedding_length")), int(need("attention.head_count"))
        n_head_kv = int(md.get(f"{arch}.attention.head_count_kv", n_head))
        if n_embd % n_head or n_head % n_head_kv:
            raise UserError(f"{where}: {n_head} heads / {n_head_kv} KV heads do not divide embedding width {n_embd}")
        head_dim = int(md.get(f"{arch}.attention.key_length", n_embd // n_head))
        if "token_embd.weight" not in tensors:
            raise UserError(f"{where}: tensor 'token_embd.weight' is missing")
        n_vocab = int(md.get(f"{arch}.vocab_size") or tensors["token_embd.weight"].shape[1])
        scaling = str(md.get(f"{arch}.rope.scaling.type", "none"))
        factor = float(md.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
        if scaling not in ("none", "linear", "yarn"):
            raise UserError(f"{where}: rope scaling type '{scaling}' is not supported")
        bos, eos = md.get("tokenizer.ggml.bos_token_id"), md.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            name=str(md.get("general.name", header.path.stem)),
            n_layers=int(need("block_count")),
            n_embd=n_embd,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            n_ff=int(need("feed_forward_length")),
            n_vocab=n_vocab,
            context_length=int(md.get(f"{arch}.context_length", 2048)),
            rope_base=float(md.get(f"{arch}.rope.freq_base", 10000.0)),
            rope_dim=int(md.get(f"{arch}.rope.dimension_count", head_dim)),
            rope_scaling_type=scaling,
            rope_scaling_factor=factor if scaling != "none" else 1.0,
            rms_eps=float(md.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            tied_output="output.weight" not in tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", True)),
            chat_template=md.get("tokenizer.chat_template"),
        )
