"""A plan as another engine's launch command: llama.cpp's server flags, or vLLM's.

For users who outgrow one machine: the same placement decisions, expressed in the flags of
an engine built for several GPUs or hosts. localrun does not re-implement those.
"""
from __future__ import annotations

import math
import shlex

from layerplan.kv_cache import KVType, kv_type
from layerplan.planner import Plan
from layerplan.units import GiB


def peer_kv(plan: Plan) -> KVType:
    """The plan's KV type in llama.cpp's and vLLM's table (a plan for localrun's engine names its
    types in the engine's words: int8 is q8_0 there)."""
    return kv_type(plan.settings.kv.name)


def llama_cpp_flags(plan: Plan) -> list[str]:
    """llama.cpp's flags for this plan (llama-server / llama-cli). Its -c is the total over all
    sequences, so it is n_ctx x n_parallel."""
    s, kv = plan.settings, peer_kv(plan)
    flags = ["-ngl", str(plan.n_gpu_layers)]
    k = plan.placement.n_cpu_moe
    if k:
        flags += ["--cpu-moe"] if k >= plan.n_layers else ["--n-cpu-moe", str(k)]
    flags += ["-c", str(s.n_kv_tokens)]
    if s.n_parallel > 1:
        flags += ["-np", str(s.n_parallel)]
    flags += ["-ub", str(s.n_ubatch)]
    if kv.name != "f16" and kv.llama_cpp:
        flags += ["-ctk", kv.llama_cpp, "-ctv", kv.llama_cpp]
    flags += ["-fa", "on" if s.flash_attention else "off"]
    split = plan.placement.gpu_split
    if len(split) > 1 and plan.n_gpu_layers:
        flags += ["-ts", ",".join(str(n) for n in split)]
    if not s.kv_offload:
        flags.append("-nkvo")
    if plan.threads is not None:
        flags += ["-t", str(plan.threads.recommended)]
    return flags


EXPERT_TENSORS = r"ffn_(up|down|gate)_exps"


def override_tensor_pattern(n_cpu_moe: int, n_layers: int) -> str:
    r"""The -ot (--override-tensor) value that keeps the routed experts of the first n_cpu_moe
    layers in host memory, as --n-cpu-moe does: `blk\.(0|1|2)\.ffn_(up|down|gate)_exps=CPU`."""
    if n_cpu_moe >= n_layers:
        return rf"\.{EXPERT_TENSORS}=CPU"
    return rf"blk\.({'|'.join(str(il) for il in range(n_cpu_moe))})\.{EXPERT_TENSORS}=CPU"


def _model_arg(plan: Plan) -> str:
    if plan.profile.path:
        return plan.profile.path
    return plan.profile.name.replace(":", "-") + ".gguf"  # a built-in shape: the file the user would fetch


def llama_server_command(plan: Plan) -> str:
    lines = []
    kv = peer_kv(plan)
    if not kv.llama_cpp:
        lines.append(f"# llama.cpp has no {kv.name} KV cache; this uses f16")
    k = plan.placement.n_cpu_moe
    if k:
        flag = "--cpu-moe" if k >= plan.n_layers else f"--n-cpu-moe {k}"
        lines.append(f"# builds without {flag.split()[0]}: the same placement with "
                     f"-ot {shlex.quote(override_tensor_pattern(k, plan.n_layers))}")
    lines.append(shlex.join(["llama-server", "-m", _model_arg(plan), *llama_cpp_flags(plan)]))
    return "\n".join(lines)


def vllm_command(plan: Plan, hf_repo: str | None = None) -> str:
    """vLLM's `serve` for the same context, parallelism and KV type. vLLM keeps the KV cache on the
    GPUs; layers that do not fit there become --cpu-offload-gb (weights streamed per step)."""
    s, profile, kv = plan.settings, plan.profile, peer_kv(plan)
    lines = []
    model = hf_repo or _model_arg(plan)
    args = ["vllm", "serve", model, "--max-model-len", str(s.n_ctx), "--max-num-seqs", str(s.n_parallel)]
    if profile.path and not hf_repo:
        lines.append("# vLLM reads a GGUF best with the original model's tokenizer: add --tokenizer <repository>")
    if kv.vllm is None:
        lines.append(f"# vLLM has no {kv.name} KV cache; fp8 is its nearest smaller type")
        args += ["--kv-cache-dtype", "fp8"]
    elif kv.vllm != "auto":
        args += ["--kv-cache-dtype", kv.vllm]
    gpus = [u for u in plan.usage if u.device.kind == "gpu"]
    if gpus:
        share = min(u.budget_bytes / u.device.total_bytes for u in gpus)
        args += ["--gpu-memory-utilization", f"{math.floor(share * 100) / 100:.2f}"]
        if len(gpus) > 1:
            args += ["--tensor-parallel-size", str(len(gpus))]
        host_weights = plan.usage[-1].weights_bytes - profile.embedding_bytes - profile.other_bytes
        if host_weights > 0:
            args += ["--cpu-offload-gb", str(math.ceil(host_weights / GiB))]
    else:
        lines.append("# no GPU in this plan: vLLM needs its CPU build for this")
    lines.append(shlex.join(args))
    return "\n".join(lines)
