"""Engine calibration: how its figures enter the speed model (a per-step overhead, the bandwidth
attention reads at), checked by hand. The fit itself: tests/test_engine_fit.py."""
from dataclasses import replace

import pytest

from layerplan import calibrate
from layerplan.devices import Device, Machine
from layerplan.model_profile import LayerProfile, ModelProfile
from layerplan.placement import place
from layerplan.settings import PlanSettings
from layerplan.speed import predict


def _toy() -> ModelProfile:
    layers = tuple(LayerProfile(index=i, weight_bytes=10_000_000, params=5_000_000, n_matmuls=4, n_head=8,
                                n_kv_head=2, head_dim_k=64, head_dim_v=64) for i in range(4))
    return ModelProfile(name="toy", architecture="llama", quantization="X", n_layers=4, d_model=512, n_ff=1024,
                        n_vocab=1000, n_ctx_train=4096, layers=layers, embedding_bytes=1_000_000,
                        output_bytes=1_000_000, head_bytes=1_000_000, head_params=512_000, tied_embeddings=False)


def test_engine_figures_enter_the_speed_model():
    host = Device("CPU", "cpu", 1 << 34, 1 << 34, memory_bandwidth=20e9, compute_flops=1e18)
    machine, profile, s = Machine(gpus=(), host=host), _toy(), PlanSettings(n_ctx=2048)
    placement = place(profile, machine, s, 0)
    base = predict(profile, machine, placement, s, decode_context=1000).decode_s_by_device[0]
    cal = calibrate.Calibration(fingerprint="x", host_bandwidth=20e9, host_flops=1e18, host_matmul_overhead_s=0.0,
                                host_layer_overhead_s=0.0, host_step_overhead_s=3e-3, host_kv_bandwidth=5e9)
    tuned = calibrate.apply(machine, cal)
    assert (tuned.host.step_overhead_s, tuned.host.kv_bandwidth) == (3e-3, 5e9)
    with_engine = predict(profile, tuned, place(profile, tuned, s, 0), s, decode_context=1000).decode_s_by_device[0]
    # f16 K and V of 1001 tokens per layer: 2 heads x 128 values x 2 bytes, now read at 5 GB/s instead of 20
    kv_bytes = 4 * 2 * 128 * 2 * 1001
    assert with_engine - base == pytest.approx(3e-3 + kv_bytes / 5e9 - kv_bytes / 20e9, rel=1e-9)
    assert replace(cal, host_kv_bandwidth=None).host_kv_bandwidth is None
    assert calibrate.apply(machine, replace(cal, host_kv_bandwidth=None)).host.kv_bandwidth == 0.0
