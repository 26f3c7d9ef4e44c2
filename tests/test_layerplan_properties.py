"""Property tests over random model shapes and machines (issue 3): no plan exceeds a device's
budget; more VRAM never gives fewer GPU layers at the same settings; pins are kept or refused
with a message."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerplan import Machine, plan
from layerplan.devices import Device
from layerplan.kv_cache import KV_TYPES
from layerplan.model_profile import LayerProfile, ModelProfile
from layerplan.units import GiB, MiB

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def profiles(draw) -> ModelProfile:
    n_layers = draw(st.integers(1, 24))
    n_kv_head = draw(st.sampled_from([1, 2, 4, 8, 32]))
    n_head = n_kv_head * draw(st.sampled_from([1, 2, 4, 8]))
    head_dim = draw(st.sampled_from([64, 128, 256]))
    d_model = n_head * head_dim
    n_vocab = draw(st.integers(1000, 256_000))
    window = draw(st.sampled_from([None, None, 512, 4096]))
    base = draw(st.integers(1 * MiB, 2 * GiB))
    layers = tuple(LayerProfile(
        index=i, weight_bytes=base + draw(st.integers(0, base // 4)), params=base, n_head=n_head,
        n_kv_head=n_kv_head, head_dim_k=head_dim, head_dim_v=head_dim,
        sliding_window=window if window and i % 2 == 0 else None) for i in range(n_layers))
    embedding = n_vocab * d_model * draw(st.sampled_from([1, 2]))
    tied = draw(st.booleans())
    output = d_model * 4 + (0 if tied else embedding)
    return ModelProfile(name="random", architecture="llama", quantization="X", n_layers=n_layers,
                        d_model=d_model, n_ff=4 * d_model, n_vocab=n_vocab, n_ctx_train=draw(st.sampled_from([2048, 8192, 131072])),
                        layers=layers, embedding_bytes=embedding, output_bytes=output,
                        head_bytes=output + (embedding if tied else 0), head_params=n_vocab * d_model,
                        tied_embeddings=tied)


def gpus():
    return st.builds(lambda free, bw, flops, link: Device(
        name="gpu", kind="gpu", total_bytes=free, free_bytes=free, memory_bandwidth=bw, compute_flops=flops,
        link_bandwidth=link, layer_overhead_s=20e-6, matmul_overhead_s=5e-6),
        st.integers(0, 48 * GiB), st.floats(50e9, 3000e9), st.floats(5e12, 500e12), st.floats(4e9, 60e9))


@st.composite
def machines(draw) -> Machine:
    ram = draw(st.integers(1 * GiB, 256 * GiB))
    host = Device(name="CPU", kind="cpu", total_bytes=ram, free_bytes=ram,
                  memory_bandwidth=draw(st.floats(5e9, 100e9)), compute_flops=draw(st.floats(50e9, 2e12)),
                  layer_overhead_s=30e-6, matmul_overhead_s=5e-6)
    return Machine(gpus=tuple(draw(st.lists(gpus(), min_size=0, max_size=3))), host=host)


@st.composite
def plan_settings(draw) -> dict:
    return dict(n_ctx=draw(st.integers(1, 65536)), n_parallel=draw(st.integers(1, 8)),
                kv_type=draw(st.sampled_from(sorted(KV_TYPES))), n_ubatch=draw(st.sampled_from([32, 512, 2048])),
                margin_bytes=draw(st.integers(0, GiB)), kv_offload=draw(st.booleans()), with_sweep=False)


@FAST
@given(profiles(), machines(), plan_settings())
def test_no_plan_exceeds_a_device_budget(profile, machine, options):
    p = plan(profile, machine, **options)
    if p.fits:
        assert all(u.total_bytes <= u.device.free_bytes - options["margin_bytes"] for u in p.usage)
    else:
        assert p.reasons, "a plan that does not fit must say why"
    weights = sum(u.weights_bytes for u in p.usage)
    head_copy = profile.embedding_bytes if profile.tied_embeddings and p.placement.head_device != len(machine.gpus) else 0
    assert weights == profile.weight_bytes + head_copy  # every weight is placed exactly once (a GPU head: a copy)


@FAST
@given(profiles(), machines(), plan_settings(), st.data())
def test_more_vram_never_gives_fewer_gpu_layers(profile, machine, options, data):
    if not machine.gpus:
        return
    before = plan(profile, machine, **options)
    g = data.draw(st.integers(0, len(machine.gpus) - 1))
    extra = data.draw(st.integers(1, 64 * GiB))
    bigger = list(machine.gpus)
    bigger[g] = bigger[g].with_free(bigger[g].free_bytes + extra)
    after = plan(profile, Machine(gpus=tuple(bigger), host=machine.host), **options)
    if before.fits:
        assert after.fits
        assert after.n_gpu_layers >= before.n_gpu_layers


@FAST
@given(profiles(), machines(), plan_settings(), st.data())
def test_pins_are_kept_or_refused_with_a_message(profile, machine, options, data):
    top = profile.n_layers + 1 if machine.gpus else 0
    pin = data.draw(st.integers(0, top))
    p = plan(profile, machine, n_gpu_layers=pin, **options)
    assert p.n_gpu_layers == pin and p.settings.n_ctx == options["n_ctx"]
    assert p.settings.kv_type == options["kv_type"] and p.settings.n_parallel == options["n_parallel"]
    if not p.fits:
        assert any("does not fit" in r or r.startswith("Nothing fits") for r in p.reasons)
        assert any(fix in p.reasons[-1] for fix in ("--gpu-layers", "--ctx", "--kv-type", "--parallel", "smaller"))
