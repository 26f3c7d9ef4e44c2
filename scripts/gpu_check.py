"""One prepared check for a machine with an NVIDIA GPU (under 5 minutes).

Runs SmolLM2-135M with 0, 15 and 30 GPU layers, and a synthetic larger model (24 layers of
4096 wide, Q4_0, random weights written with gguf.GGUFWriter) on the CPU and fully on the GPU,
and prints, per run, the measured GPU memory and prefill / decode tok/s next to layerplan's
prediction for the same placement. Prints a table, then one JSON object as the last line.

    .venv/bin/python scripts/gpu_check.py [--model smollm2-135m] [--big-layers 24] [--big-width 4096]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))          # synthetic_gguf: the tiny BPE vocabulary


def write_big_q4_0(path: Path, n_layers: int, n_embd: int, n_ff: int, n_vocab: int = 320) -> Path:
    """A llama GGUF of random Q4_0 blocks (no float weights are ever made: fast to write)."""
    import gguf
    from synthetic_gguf import BOS_TOKEN_ID, CHATML_TEMPLATE, EOS_TOKEN_ID, tiny_bpe_vocab

    rng = np.random.default_rng(0)
    n_head, n_head_kv = n_embd // 128, max(1, n_embd // 512)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("synthetic-q4_0")
    for add, value in [(writer.add_vocab_size, n_vocab), (writer.add_context_length, 4096),
                       (writer.add_embedding_length, n_embd), (writer.add_block_count, n_layers),
                       (writer.add_feed_forward_length, n_ff), (writer.add_head_count, n_head),
                       (writer.add_head_count_kv, n_head_kv), (writer.add_rope_dimension_count, 128)]:
        add(value)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    tokens, types, merges = tiny_bpe_vocab(n_vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_TOKEN_ID)
    writer.add_eos_token_id(EOS_TOKEN_ID)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML_TEMPLATE)

    def q4_0(n_out: int, n_in: int) -> np.ndarray:
        blocks = rng.integers(0, 256, size=(n_out * n_in // 32, 18), dtype=np.uint8)
        d = np.full(len(blocks), 1.0 / (8 * np.sqrt(n_in)), dtype=np.float16)
        blocks[:, :2] = d.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(n_out, n_in // 32 * 18)

    def norm() -> np.ndarray:
        return np.ones(n_embd, dtype=np.float32)

    head_dim = n_embd // n_head
    writer.add_tensor("token_embd.weight", q4_0(n_vocab, n_embd), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
    for i in range(n_layers):
        p = f"blk.{i}."
        for name, shape in [("attn_q", (n_embd, n_embd)), ("attn_k", (n_head_kv * head_dim, n_embd)),
                            ("attn_v", (n_head_kv * head_dim, n_embd)), ("attn_output", (n_embd, n_embd)),
                            ("ffn_gate", (n_ff, n_embd)), ("ffn_up", (n_ff, n_embd)), ("ffn_down", (n_embd, n_ff))]:
            writer.add_tensor(p + name + ".weight", q4_0(*shape), raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        writer.add_tensor(p + "attn_norm.weight", norm())
        writer.add_tensor(p + "ffn_norm.weight", norm())
    writer.add_tensor("output_norm.weight", norm())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def predicted(path, n_gpu_layers: int, n_ctx: int, prompt_tokens: int) -> tuple[float, float]:
    import layerplan
    plan = layerplan.plan(layerplan.profile_gguf(path), layerplan.probe_machine(), n_ctx=n_ctx,
                          n_gpu_layers=n_gpu_layers, prompt_tokens=prompt_tokens, with_sweep=False)
    return plan.predicted.prefill_tok_s, plan.predicted.decode_tok_s


def run_one(path, label: str, n_gpu_layers: int, prompt_tokens: int, gen_tokens: int) -> dict:
    import torch

    from localrun import LLM
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    llm = LLM(path, n_ctx=prompt_tokens + gen_tokens + 16, n_gpu_layers=n_gpu_layers, n_parallel=1,
              kv_budget_bytes=None)
    load_s = time.perf_counter() - t0
    weights_gib = (torch.cuda.memory_allocated() - base) / 2**30
    ids = (llm.tokenize("The history of the city is long and full of stories. " * 200))[:prompt_tokens]
    llm.generate(ids[:16], max_tokens=2, temperature=0, ignore_eos=True)            # warm-up
    llm.reset()
    torch.cuda.synchronize()
    r = llm.generate(ids, max_tokens=gen_tokens + 1, temperature=0, ignore_eos=True)
    torch.cuda.synchronize()
    pred_prefill, pred_decode = predicted(path, n_gpu_layers, llm.n_ctx, prompt_tokens)
    row = {"model": label, "n_gpu_layers": n_gpu_layers, "plan": llm.plan_summary, "load_s": round(load_s, 1),
           "gpu_weights_gib": round(weights_gib, 3),
           "gpu_peak_gib": round((torch.cuda.max_memory_allocated() - base) / 2**30, 3),
           "prefill_tok_s": round(r.timings["prefill_tok_s"], 1), "predicted_prefill_tok_s": round(pred_prefill, 1),
           "decode_tok_s": round(r.timings["decode_tok_s"], 1), "predicted_decode_tok_s": round(pred_decode, 1),
           "weights": type(llm.model.layers[-1].attention.wqkv).__name__}
    del llm
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--gpu-layers", default="0,15,30")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--big-layers", type=int, default=24)
    ap.add_argument("--big-width", type=int, default=4096)
    ap.add_argument("--big-ff", type=int, default=11008)
    args = ap.parse_args()

    import torch
    if not torch.cuda.is_available():
        print("no CUDA GPU here (torch.cuda.is_available() is False); this check needs one", file=sys.stderr)
        print(json.dumps({"benchmark": "gpu_check", "error": "no CUDA GPU"}))
        sys.exit(1)
    from localrun.model.quant import int4_backend
    from localrun.models import resolve_model
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, int4 kernel on cuda: "
          f"{int4_backend('cuda') is not None}", flush=True)
    rows = []
    path = resolve_model(args.model)
    for n in [int(v) for v in args.gpu_layers.split(",")]:
        rows.append(run_one(path, path.name, n, args.prompt_tokens, args.gen_tokens))
        print(rows[-1], flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        big = write_big_q4_0(Path(tmp) / "synthetic-q4_0.gguf", args.big_layers, args.big_width, args.big_ff)
        print(f"wrote {big.stat().st_size / 2**30:.2f} GiB synthetic model in {time.perf_counter() - t0:.0f}s",
              flush=True)
        label = f"synthetic {args.big_layers}x{args.big_width} Q4_0"
        for n in (0, args.big_layers + 1):
            rows.append(run_one(big, label, n, min(args.prompt_tokens, 256), min(args.gen_tokens, 16)))
            print(rows[-1], flush=True)

    cols = ["model", "n_gpu_layers", "gpu_weights_gib", "gpu_peak_gib", "prefill_tok_s", "predicted_prefill_tok_s",
            "decode_tok_s", "predicted_decode_tok_s", "weights"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r[c]) for c in cols) + " |")
    print(json.dumps({"benchmark": "gpu_check", "gpu": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
