"""The plan as one JSON-ready dict (`localrun plan --json`); docs/layerplan.md describes the schema."""
from __future__ import annotations

from layerplan.emit import llama_cpp_flags
from layerplan.planner import Plan

SCHEMA_VERSION = 2


def plan_to_dict(plan: Plan) -> dict:
    s, p = plan.settings, plan.predicted
    return {
        "schema_version": SCHEMA_VERSION,
        "model": plan.profile.name,
        "source": plan.profile.source,
        "quantization": plan.profile.quantization,
        "weights_bytes": plan.profile.weight_bytes,
        "n_layers": plan.n_layers,
        "n_gpu_layers": plan.n_gpu_layers,
        "n_cpu_moe": plan.n_cpu_moe,
        "moe": _moe(plan),
        "auto": plan.auto,
        "fits": plan.fits,
        "reasons": list(plan.reasons),
        "ctx": s.n_ctx,
        "parallel": s.n_parallel,
        "kv_type": s.kv.name,
        "kv_offload": s.kv_offload,
        "batch": s.n_ubatch,
        "margin_bytes": s.margin_bytes,
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "devices": [{
            "name": u.device.name,
            "kind": u.device.kind,
            "weights_bytes": u.weights_bytes,
            "kv_bytes": u.kv_bytes,
            "buffer_bytes": u.buffer_bytes,
            "total_bytes": u.total_bytes,
            "free_bytes": u.device.free_bytes,
            "budget_bytes": u.budget_bytes,
            "headroom_bytes": u.headroom_bytes,
            "kv_budget_bytes": budget,
            "n_layers": u.n_layers,
            "holds_output_head": u.holds_head,
            "source": u.device.source,
        } for u, budget in zip(plan.usage, plan.kv_budget_bytes())],
        "predicted": {
            "decode_tok_s": round(p.decode_tok_s, 3),
            "decode_tok_s_total": round(p.decode_tok_s_total, 3),
            "prefill_tok_s": round(p.prefill_tok_s, 3),
            "ttft_s": round(p.ttft_s, 4),
            "prompt_tokens": p.prompt_tokens,
            "decode_context": p.decode_context,
        },
        "sweep": [{"n_gpu_layers": r.n_gpu_layers, "fits": r.fits, "decode_tok_s": round(r.decode_tok_s, 3),
                   "max_ctx": r.max_ctx} for r in plan.sweep],
        "llama_cpp_flags": llama_cpp_flags(plan),
        "preference": plan.preference,
        "ledger": None if plan.ledger is None else [
            {"device": plan.ledger.devices[i.device].name, "device_index": i.device, "what": i.what,
             "bytes": i.n_bytes, "mapped": i.mapped} for i in plan.ledger.items],
        "threads": None if plan.threads is None else {
            "recommended": plan.threads.recommended, "physical_cores": plan.threads.physical_cores,
            "logical_cores": plan.threads.logical_cores, "load_1m": round(plan.threads.load_1m, 2),
            "busy_cores": plan.threads.busy_cores},
        "menu": [{"ctx": e.n_ctx, "kv_type": e.kv_type, "parallel": e.n_parallel, "n_gpu_layers": e.n_gpu_layers,
                  "n_cpu_moe": e.n_cpu_moe, "decode_tok_s": round(e.decode_tok_s, 3),
                  "decode_tok_s_total": round(e.decode_tok_s_total, 3), "prefill_tok_s": round(e.prefill_tok_s, 3),
                  "gpu_bytes": e.gpu_bytes, "host_bytes": e.host_bytes} for e in plan.menu],
    }


def _moe(plan: Plan) -> dict | None:
    """The MoE facts of the plan, None for a dense model."""
    p = plan.profile
    if not p.is_moe:
        return None
    in_ram = sum(layer.expert_bytes for layer in p.layers[:plan.n_cpu_moe])
    in_ram += sum(layer.expert_bytes for il, layer in enumerate(p.layers)
                  if il >= plan.n_cpu_moe and plan.placement.layer_devices[il] == len(plan.machine.gpus))
    return {"n_expert": p.n_expert, "n_expert_used": p.n_expert_used, "n_expert_shared": p.n_expert_shared,
            "expert_bytes": p.expert_bytes, "expert_bytes_in_ram": in_ram,
            "active_expert_bytes_per_token": round(p.active_expert_bytes), "engine_runs_it": False}
