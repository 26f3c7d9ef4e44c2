"""layerplan: a torch-free offload planner for GGUF models.

Where does each part of a model go (weights, KV cache, buffers on GPU or host), and how fast
will it run? Profile a model from its GGUF header (or a built-in shape), describe the machine,
and plan:

    profile = layerplan.profile_gguf("model.gguf")        # or profile_builtin("llama3.1-8b:q4_k_m")
    machine = layerplan.build_machine(vram=["24GiB"])     # or probe_machine()
    plan = layerplan.plan(profile, machine, n_ctx=16384, n_parallel=2)
    plan.n_gpu_layers, plan.fits, plan.reasons, plan.predicted.decode_tok_s

Imports neither torch nor localrun.
"""
from layerplan.builtin_shapes import SHAPES, profile_builtin
from layerplan.calibrate import Calibration, measure
from layerplan.devices import Device, Machine
from layerplan.emit import llama_cpp_flags, llama_server_command, vllm_command
from layerplan.gguf_header import GGUFFormatError, read_header
from layerplan.gpu_presets import GPU_PRESETS
from layerplan.kv_cache import KV_TYPES, kv_bytes_per_token, kv_type
from layerplan.machine_spec import build_machine
from layerplan.model_profile import LayerProfile, ModelProfile, profile_gguf
from layerplan.placement import DeviceUsage, Placement, place
from layerplan.planner import Plan, PlanError, SweepRow, max_context, plan
from layerplan.probe import probe_machine
from layerplan.report import plan_to_dict
from layerplan.settings import PlanSettings
from layerplan.speed import Predicted, predict

__all__ = [
    "SHAPES", "profile_builtin", "Calibration", "measure", "Device", "Machine", "llama_cpp_flags",
    "llama_server_command", "vllm_command", "GGUFFormatError", "read_header", "GPU_PRESETS", "KV_TYPES",
    "kv_bytes_per_token", "kv_type", "build_machine", "LayerProfile", "ModelProfile", "profile_gguf",
    "DeviceUsage", "Placement", "place", "Plan", "PlanError", "SweepRow", "max_context", "plan",
    "probe_machine", "plan_to_dict", "PlanSettings", "Predicted", "predict",
]
