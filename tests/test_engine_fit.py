"""The engine calibration's fit (layerplan.engine_fit): timings that the speed model itself predicts
for known figures give those figures back; noise never gives a negative cost; and the new figures
(decode flop/s, unpack bandwidth) act in the speed model where they should, checked by hand."""
import math
from dataclasses import replace

import pytest

from layerplan import engine_fit
from layerplan.devices import Device, Machine
from layerplan.engine_fit import EngineTimings, _Model, fit_host, residuals
from layerplan.model_profile import LayerProfile, ModelProfile
from layerplan.placement import place
from layerplan.settings import PlanSettings
from layerplan.speed import chunk_parts, predict, prefill_steps, step_seconds


def _toy(n_layers: int = 12) -> ModelProfile:
    layers = tuple(LayerProfile(index=i, weight_bytes=2_000_000, params=4_000_000, n_matmuls=4, n_head=8,
                                n_kv_head=2, head_dim_k=64, head_dim_v=64) for i in range(n_layers))
    return ModelProfile(name="toy", architecture="llama", quantization="X", n_layers=n_layers, d_model=512,
                        n_ff=1536, n_vocab=32000, n_ctx_train=4096, layers=layers, embedding_bytes=8_000_000,
                        output_bytes=0, head_bytes=8_000_000, head_params=16_000_000, tied_embeddings=True)


TRUE_HOST = Device("CPU", "cpu", 1 << 34, 1 << 34, memory_bandwidth=30e9, compute_flops=250e9,
                   matmul_overhead_s=10e-6, layer_overhead_s=150e-6, step_overhead_s=4e-3, kv_bandwidth=9e9,
                   kv_cached_bytes=3e6,
                   decode_flops=80e9, unpack_bandwidth=0.5e9, attention_flops=150e9, causal_attention_flops=300e9)


def _timings(profile: ModelProfile, host: Device, kv_type: str = "f16") -> EngineTimings:
    m = _Model(profile, kv_type)
    return EngineTimings(n_layers_short=4, batch=4, fill_short=40.0, fill_long=1040.0,
                         decode_short_shallow_s=m.decode(host, 1, 40.0, 4), decode_short_s=m.decode(host, 1, 40.0),
                         decode_batch_s=m.decode(host, 4, 40.0), decode_batch_long_s=m.decode(host, 4, 1040.0),
                         prompt_tokens=(128, 384, 1024), prefill_s=tuple(m.prefill(host, n) for n in (128, 384, 1024)),
                         attention_tokens=1024, prefill_split_s=m.prefill(host, 1024, n_prompts=4),
                         prefill_cached_s=m.prefill(host, 1024, 1024), decode_long_s=m.decode(host, 1, 1040.0),
                         fill_longer=2080.0, decode_longer_s=m.decode(host, 1, 2080.0))


def test_timings_the_model_predicts_give_back_their_figures():
    profile = _toy()
    start = replace(TRUE_HOST, layer_overhead_s=0.0, step_overhead_s=0.0, kv_bandwidth=0.0, decode_flops=0.0,
                    unpack_bandwidth=0.0, attention_flops=0.0, causal_attention_flops=0.0,
                    compute_flops=100e9)   # what the micro-benchmarks knew
    fitted = fit_host(profile, start, "f16", _timings(profile, TRUE_HOST))
    for name in ("kv_bandwidth", "kv_cached_bytes", "decode_flops", "compute_flops", "unpack_bandwidth", "attention_flops",
                 "causal_attention_flops"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE_HOST, name), rel=1e-3), name
    # each call's fixed cost moves into the layer's (4 matmuls) and the step's (the head's one)
    assert fitted.matmul_overhead_s == 0.0
    assert fitted.layer_overhead_s == pytest.approx(150e-6 + 4 * 10e-6, rel=1e-3)
    assert fitted.step_overhead_s == pytest.approx(4e-3 + 10e-6, rel=1e-3)
    assert fitted.memory_bandwidth == 30e9   # kept as given
    assert all(r == pytest.approx(1.0, rel=1e-6) for r in residuals(profile, fitted, "f16",
                                                                   _timings(profile, TRUE_HOST)).values())


def test_a_matvec_overhead_beyond_the_engines_layer_cost_does_not_bend_the_fit():
    """The micro-benchmarks' matvec overhead (torch's matvec, not the engine's kernels) measured
    300 us a call on a 2-core Zen 3, where a whole layer of the engine took 280 us: kept, it made
    every decode step of the model 1.5-2x the engine's."""
    profile = _toy()
    t = _timings(profile, TRUE_HOST)
    fitted = fit_host(profile, replace(TRUE_HOST, matmul_overhead_s=300e-6), "f16", t)
    assert all(r == pytest.approx(1.0, rel=1e-3) for r in residuals(profile, fitted, "f16", t).values())
    machine, settings, placement = _host_only(profile, TRUE_HOST)
    truth = predict(profile, machine, placement, settings)
    got = predict(profile, Machine(gpus=(), host=fitted), placement, settings)
    assert got.decode_tok_s == pytest.approx(truth.decode_tok_s, rel=1e-3)


def test_no_unpacking_cost_is_found_where_there_is_none():
    profile, host = _toy(), replace(TRUE_HOST, unpack_bandwidth=0.0)
    fitted = fit_host(profile, replace(host, compute_flops=50e9), "f16", _timings(profile, host))
    assert fitted.unpack_bandwidth == 0.0 and fitted.compute_flops == pytest.approx(250e9, rel=1e-3)


def test_noise_never_gives_a_negative_cost_nor_an_infinite_rate():
    profile = _toy()
    # the shallow stack slower than the whole one, the long fill faster than the short, 4 rows as fast as 1
    t = replace(_timings(profile, TRUE_HOST), decode_short_shallow_s=1.0, decode_batch_long_s=0.001, decode_long_s=0.001,
                decode_longer_s=0.001)
    t = replace(t, decode_batch_s=t.decode_short_s)
    start = replace(TRUE_HOST, kv_bandwidth=7e9, decode_flops=0.0)
    fitted = fit_host(profile, start, "f16", t)
    assert fitted.layer_overhead_s == 0.0 and fitted.step_overhead_s >= 0.0
    assert (fitted.kv_bandwidth, fitted.kv_cached_bytes, fitted.decode_flops) == (7e9, 0.0, 0.0)    # not measurable: the figures given are kept
    assert 0 < fitted.compute_flops < 1e16


def test_a_rate_at_the_top_of_the_range_is_taken_as_unseen(monkeypatch):
    """A cost too small to show in the timings (a tiny model's attention) drives its rate to the top
    of the search range: the fit then keeps the stand-in (0.0: the speed model reads compute_flops
    in its place; the bisection's rates: the figure given), never a rate of ~1e16 (seen on an
    AVX-512 host: exp(log(1e16)) = 1.0000000000000034e16)."""
    assert engine_fit._solve_rate(lambda r: 1.0 / r, 1.5e-16, unseen=7.0) == 7.0
    assert engine_fit._solve_rate(lambda r: 1.0 / r, 1e-11, unseen=7.0) == pytest.approx(1e11, rel=1e-9)
    top = math.log(engine_fit.RATE_RANGE[1])
    solve = engine_fit._solve_logs
    monkeypatch.setattr(engine_fit, "_solve_logs", lambda f, m, start: solve(f, m, start)[:2] + [top, top])
    profile = _toy()
    fitted = fit_host(profile, TRUE_HOST, "f16", _timings(profile, TRUE_HOST))
    assert (fitted.attention_flops, fitted.causal_attention_flops) == (0.0, 0.0)
    assert fitted.compute_flops == pytest.approx(250e9, rel=1e-2)


def _host_only(profile, host, n_parallel=1, n_ubatch=512):
    machine = Machine(gpus=(), host=host)
    settings = PlanSettings(n_ctx=2048, n_parallel=n_parallel, n_ubatch=n_ubatch, margin_bytes=0)
    return machine, settings, place(profile, machine, settings, 0)


def test_decode_rows_run_at_the_decode_rate_and_prompt_steps_pay_the_unpacking():
    profile = _toy(n_layers=1)
    host = Device("CPU", "cpu", 1 << 34, 1 << 34, memory_bandwidth=1e12, compute_flops=100e9, decode_flops=10e9,
                  unpack_bandwidth=1e9, kv_bandwidth=1e15, attention_flops=50e9, causal_attention_flops=200e9)
    machine, settings, placement = _host_only(profile, host, n_parallel=4)
    # 4 decode rows: (layer 4e6 params + head 16e6) x 2 flops x 4 rows at 10 GFLOP/s; no unpacking
    decode = step_seconds(profile, machine, placement, settings, ((1, 0.0),) * 4, n_logits=4, decode=True)
    assert decode == pytest.approx(2 * 4 * (4e6 + 16e6) / 10e9, rel=1e-6)
    # a 100-token prompt from an empty cache: its matmuls at 100 GFLOP/s, 2 MB unpacked at 1 GB/s, causal
    # attention (100 queries over 50 keys on average, 8 heads of 64 + 64) at 200 GFLOP/s, the head's row at 10
    prompt = step_seconds(profile, machine, placement, settings, ((100, 0),), n_logits=1, decode=False)
    matmuls_and_head = 2 * 100 * 4e6 / 100e9 + 2e6 / 1e9 + 2 * 16e6 / 10e9
    assert prompt == pytest.approx(matmuls_and_head + 2 * 100 * 50 * 8 * 128 / 200e9, rel=1e-6)
    # the same 100 tokens after 300 cached: the cached keys unmasked at 50 GFLOP/s, its own causally
    later = step_seconds(profile, machine, placement, settings, ((100, 300),), n_logits=1, decode=False)
    assert later == pytest.approx(matmuls_and_head + 2 * 100 * 300 * 8 * 128 / 50e9 + 2 * 100 * 50 * 8 * 128 / 200e9,
                                  rel=1e-6)


def test_prompts_that_arrive_together_share_steps_oldest_first():
    # ((new tokens, tokens cached before them) per prompt in the step, prompts the step finishes)
    assert prefill_steps(479, 4, 2048) == [(((479, 0),) * 4, 4)]
    assert prefill_steps(1000, 3, 1500) == [(((1000, 0), (500, 0)), 1), (((500, 500), (1000, 0)), 2)]
    assert prefill_steps(700, 1, 512) == [(((512, 0),), 0), (((188, 512),), 1)]
    # a prompt's first chunk attends causally (half its own tokens on average); a later one over every
    # cached key unmasked, then causally over its own; in a sliding-window layer, one masked call
    assert chunk_parts(0, 512) == ((256, True),)
    assert chunk_parts(512, 188) == ((512, False), (94, True))
    assert chunk_parts(512, 188, window=256) == ((700, False),)
    # the unpacking is paid once per step, so four prompts in one step cost less per token than one
    profile = _toy()
    host = replace(TRUE_HOST, unpack_bandwidth=0.2e9)
    machine, settings, placement = _host_only(profile, host, n_parallel=4, n_ubatch=2048)
    one = predict(profile, machine, placement, settings, prompt_tokens=479)
    four = predict(profile, machine, placement, settings, prompt_tokens=479, prompts_together=4)
    assert four.prompts_together == 4 and four.prefill_tok_s > one.prefill_tok_s
    assert four.ttft_s == pytest.approx(step_seconds(profile, machine, placement, settings, ((479, 0),) * 4,
                                                     n_logits=4, decode=False), rel=1e-9)


def test_the_kv_bandwidth_is_one_sequences_and_the_batch_has_its_own_rate():
    """The KV bandwidth comes from one sequence's decode steps at the long fill against the short
    one: four rows over a long cache that run slower per row (here twice the attention time; on
    2 Zen 3 cores they ran about twice as fast per byte) do not move it (on 2 Zen 4 cores the batch
    gave 12 GB/s where one sequence read at ~17); they get their own rate, at 4 rows, which
    reproduces their timing. A calibration from before the one-sequence timing falls back to the
    batch's for both."""
    profile = _toy()
    start = replace(TRUE_HOST, kv_bandwidth=1e9)
    t = _timings(profile, TRUE_HOST)
    slow_batch = replace(t, decode_batch_long_s=t.decode_batch_s + 2 * (t.decode_batch_long_s - t.decode_batch_s))
    fitted = fit_host(profile, start, "f16", slow_batch)
    assert fitted.kv_bandwidth == pytest.approx(TRUE_HOST.kv_bandwidth, rel=1e-3)
    assert fitted.kv_batch_rows == 4 and fitted.kv_batch_bandwidth < 0.6 * TRUE_HOST.kv_bandwidth
    r = residuals(profile, fitted, "f16", slow_batch)
    assert r["decode_long"] == pytest.approx(1.0, rel=1e-3) and r["decode_batch_long"] == pytest.approx(1.0, rel=1e-3)
    same = fit_host(profile, start, "f16", t)      # a batch that reads as one row does: the same rate
    assert same.kv_batch_bandwidth == pytest.approx(TRUE_HOST.kv_bandwidth, rel=1e-3)
    older = fit_host(profile, start, "f16", replace(slow_batch, decode_long_s=None))
    assert older.kv_bandwidth < 0.8 * TRUE_HOST.kv_bandwidth and older.kv_batch_bandwidth == 0.0
    assert residuals(profile, older, "f16", replace(slow_batch, decode_long_s=None))["decode_batch_long"] == \
        pytest.approx(1.0, rel=1e-3)


def test_a_batch_reads_its_kv_at_its_rate_linear_in_rows_from_one():
    """By hand: 6144 KV bytes a token (12 layers), nothing cached, flops free. One row reads at
    kv_bandwidth (1 GB/s), 4 rows and more at kv_batch_bandwidth (4 GB/s), 2 rows a third of the
    way (2 GB/s); a prompt step reads at kv_bandwidth."""
    profile = _toy()
    host = replace(TRUE_HOST, kv_bandwidth=1e9, kv_cached_bytes=0.0, kv_batch_bandwidth=4e9, kv_batch_rows=4,
                   attention_flops=1e18, causal_attention_flops=1e18)
    machine, settings, placement = _host_only(profile, host, n_parallel=8)

    def added(rows, decode=True, q=1):     # seconds a fill of 1000 adds over one of 40
        def step(fill):
            return step_seconds(profile, machine, placement, settings, ((q, fill),) * rows, n_logits=rows,
                                decode=decode)
        return step(1000.0) - step(40.0)
    assert added(1) == pytest.approx(6144 * 960 / 1e9, rel=1e-6)
    assert added(2) == pytest.approx(2 * 6144 * 960 / 2e9, rel=1e-6)
    assert added(4) == pytest.approx(4 * 6144 * 960 / 4e9, rel=1e-6)
    assert added(8) == pytest.approx(8 * 6144 * 960 / 4e9, rel=1e-6)
    assert added(2, decode=False, q=16) == pytest.approx(2 * 6144 * 960 / 1e9, rel=1e-6)


def _kv_bytes(profile, fill):
    return _Model(profile, "f16").decode_kv_bytes(TRUE_HOST, 1, fill)


def test_kv_within_the_cpus_caches_is_free_and_past_them_costs_the_bandwidth():
    """By hand: a toy layer's f16 KV is 2 heads x 64 x (k + v) x 2 bytes = 512 bytes a token, 12
    layers 6144; with 3 MB kept in the caches, a step over 1000 cached tokens (6.1 MB) reads
    3.1 MB from memory, and one over 400 (2.5 MB) nothing."""
    profile = _toy()
    assert _kv_bytes(profile, 1000.0) == pytest.approx(6144 * 1001)
    host = replace(TRUE_HOST, kv_bandwidth=1e9, attention_flops=1e15)
    machine, settings, placement = _host_only(profile, host)

    def step(h, fill):
        return step_seconds(profile, Machine(gpus=(), host=h), placement, settings, ((1, fill),), n_logits=1,
                            decode=True)
    nothing_cached = replace(host, kv_cached_bytes=0.0)
    assert step(host, 1000.0) - step(nothing_cached, 1000.0) == pytest.approx(-3e6 / 1e9, rel=1e-6)
    attention_flops = 2 * (400 - 40) * 8 * 128 * 12 / 1e15     # a row's q.k and p.v, 8 heads, 12 layers
    assert step(host, 400.0) - step(host, 40.0) == pytest.approx(attention_flops, rel=1e-6)
    # at 1000 tokens the bytes bind (3.1 ms), at 400 the flops (nothing is read from memory)
    assert step(host, 1000.0) - step(host, 400.0) == pytest.approx(
        (6144 * 1001 - 3e6) / 1e9 - 2 * 400 * 8 * 128 * 12 / 1e15, rel=1e-9)


def test_a_long_fill_within_the_caches_puts_what_they_hold_at_its_bytes():
    """Timings at three fills where the long fill costs nothing over the short one: the caches hold
    at least its bytes; the fit takes exactly those (the least the timings allow) and the bandwidth
    from the longer fill, which it then reproduces."""
    profile = _toy()
    host = replace(TRUE_HOST, kv_cached_bytes=8e6, attention_flops=1e15)   # past the long fill's 6.4 MB
    t = _timings(profile, host)
    fitted = fit_host(profile, replace(host, kv_cached_bytes=0.0), "f16", t)
    assert fitted.kv_cached_bytes == pytest.approx(_kv_bytes(profile, 1040.0), rel=1e-3)
    r = residuals(profile, fitted, "f16", t)
    assert r["decode_longer"] == pytest.approx(1.0, rel=1e-6) and r["decode_long"] == pytest.approx(1.0, rel=1e-6)
    # without the longer fill, nothing is taken as cached: the bandwidth comes from the long fill
    older = fit_host(profile, TRUE_HOST, "f16", replace(t, fill_longer=None, decode_longer_s=None))
    assert older.kv_cached_bytes == 0.0


def test_decode_over_a_cache_type_with_its_own_rate_runs_at_it_and_nothing_else_does():
    """By hand: the caches hold every byte (so only the flops count), 12 layers of 8 heads x (64 +
    64): a decode row over 1000 cached tokens of q8_0 KV at kv_decode_flops' 10 GFLOP/s costs
    2 x 1000 x 8 x 128 x 12 flops / 10e9 more than at the 150 GFLOP/s of attention_flops; 4 rows
    and more run at the batch's 40 GFLOP/s, 2 rows a third of the way (20); f16 decode rows and
    q8_0 prompt steps keep attention_flops."""
    profile = _toy()
    plain = replace(TRUE_HOST, kv_cached_bytes=1e12)
    typed = replace(plain, kv_decode_flops=(("q8_0", 10e9, 40e9, 4),))

    def step(host, kv, q=1, rows=1):
        machine, settings, placement = _host_only(profile, host, n_parallel=rows)
        settings = replace(settings, kv_type=kv)
        return step_seconds(profile, machine, placement, settings, ((q, 1000.0),) * rows, n_logits=rows,
                            decode=q == 1)
    flops = 2 * 1000 * 8 * 128 * 12
    for rows, rate in ((1, 10e9), (2, 20e9), (4, 40e9), (8, 40e9)):
        assert step(typed, "q8_0", rows=rows) - step(plain, "q8_0", rows=rows) == pytest.approx(
            rows * (flops / rate - flops / 150e9), rel=1e-6), rows
    assert step(typed, "int8") == step(typed, "q8_0")          # the engine's name of the same type
    assert step(typed, "f16") == step(plain, "f16")
    assert step(typed, "q8_0", q=16) == step(plain, "q8_0", q=16)


def test_another_cache_types_decode_rates_come_from_its_own_fills():
    """Timings the model predicts for an int8 cache decoded at 20 GFLOP/s by one row and 50 by 4
    (its 1040-token fill bound by the flops: its 3.4 MB of bytes barely pass the 3 MB the caches
    keep) give those rates back, the calibration's own figures unchanged, and reproduce its long
    fills; an fp8 cache timed at the plain attention rate gets that rate for one row, and for 4
    (bound by their bytes) a rate that never binds. Long steps that cost no more than the model
    makes them with no rate binding (the bytes alone) give no rate for the type. Steps dearer by
    a fixed cost at every fill (a quantized cache's writes) still have their long steps reproduced."""
    profile = _toy()
    truth = replace(TRUE_HOST, kv_decode_flops=(("q8_0", 20e9, 50e9, 4),))
    q8, fp8 = _Model(profile, "int8"), _Model(profile, "fp8")
    t = replace(_timings(profile, truth), kv_types=tuple(
        (name, m.decode(truth, 1, 40.0), m.decode(truth, 1, 1040.0), m.decode(truth, 4, 40.0), m.decode(truth, 4, 1040.0))
        for name, m in (("int8", q8), ("fp8", fp8))))
    fitted = fit_host(profile, replace(TRUE_HOST, kv_bandwidth=1e9), "f16", t)
    rates = {name: (one, batch, rows) for name, one, batch, rows in fitted.kv_decode_flops}
    assert rates["q8_0"] == pytest.approx((20e9, 50e9, 4), rel=1e-3)
    # fp8: one row bound by the flops at the plain rate; 4 rows by their 11 MB past the caches
    assert rates["fp8"][:2] == pytest.approx((TRUE_HOST.attention_flops, engine_fit.UNSEEN_RATE), rel=1e-3)
    for name in ("kv_bandwidth", "kv_cached_bytes", "attention_flops", "decode_flops"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUE_HOST, name), rel=1e-3), name
    r = residuals(profile, fitted, "f16", t)
    for key in ("decode_long_int8", "decode_batch_long_int8", "decode_long_fp8", "decode_batch_long_fp8"):
        assert r[key] == pytest.approx(1.0, rel=1e-6), key
    short_one, short_batch = t.kv_types[0][1], t.kv_types[0][3]
    bytes_only = replace(TRUE_HOST, kv_decode_flops=(("q8_0", engine_fit.UNSEEN_RATE, engine_fit.UNSEEN_RATE, 4),))
    free_one, free_batch = (0.999 * q8.decode(bytes_only, rows, 1040.0) for rows in (1, 4))
    free = replace(t, kv_types=(("int8", short_one, free_one, short_batch, free_batch),))
    assert fit_host(profile, TRUE_HOST, "f16", free).kv_decode_flops == ()
    unseen = replace(t, kv_types=(("int8", *t.kv_types[0][1:4], free_batch),))   # the batch's flops never show
    assert fit_host(profile, TRUE_HOST, "f16", unseen).kv_decode_flops[0][2] == engine_fit.UNSEEN_RATE
    # one row's long fill free, the batch's dear: one row never binds, the batch keeps its rate
    one_free = replace(t, kv_types=(("int8", short_one, free_one, *t.kv_types[0][3:5]),))
    kept = fit_host(profile, TRUE_HOST, "f16", one_free)
    (name, one, batch, rows), = kept.kv_decode_flops
    assert (name, one, rows) == ("q8_0", engine_fit.UNSEEN_RATE, 4) and 1e9 < batch < 1e12
    assert residuals(profile, kept, "f16", one_free)["decode_batch_long_int8"] == pytest.approx(1.0, rel=1e-6)
    # every int8 step 1 ms dearer than the model's, short and long: the long steps still reproduced
    # (their fill's cost over the short step is the same; fitting that difference missed them by the ms)
    dear = replace(t, kv_types=(("int8", *(s + 1e-3 for s in t.kv_types[0][1:5])),))
    r = residuals(profile, fit_host(profile, TRUE_HOST, "f16", dear), "f16", dear)
    assert r["decode_long_int8"] == pytest.approx(1.0, rel=1e-6) and r["decode_batch_long_int8"] == pytest.approx(1.0, rel=1e-6)


def test_the_knee_is_the_least_squares_one_by_hand():
    """_knee_line: steps reading b bytes against one reading 1 byte, seconds d. By hand: d = b - 2
    for b = 3, 5, 9 is the line k = 1 past C = 2; d = b - 1 is no knee (C = 0, the short fill's
    byte cannot be told from it); 7.5 for the last puts the weighted line (means 17/3 and 11.5/3,
    slope 20.333 / 18.667 = 1.0893) through C = 17/3 - 11.5/3 / 1.0893 = 2.1475; a cost that shows
    at the last fill only puts C at the fill before it (the least the timings allow); no cost to
    see gives None."""
    from layerplan.engine_fit import _knee_line
    ones = [1.0, 1.0, 1.0]
    assert _knee_line(1.0, [3.0, 5.0, 9.0], [1.0, 3.0, 7.0], ones) == pytest.approx((2.0, 1.0))
    assert _knee_line(1.0, [3.0, 5.0, 9.0], [2.0, 4.0, 8.0], ones) == pytest.approx((0.0, 1.0))
    assert _knee_line(1.0, [3.0, 5.0, 9.0], [1.0, 3.0, 7.5], ones) == pytest.approx((2.1475, 1.0893), rel=1e-4)
    assert _knee_line(1.0, [3.0, 5.0, 9.0], [0.0, 0.0, 4.0], ones) == pytest.approx((5.0, 1.0))
    assert _knee_line(1.0, [3.0, 5.0, 9.0], [0.0, 0.0, 0.0], ones) is None
    # the weights count: a heavy first fill pulls the line through it
    c, k = _knee_line(1.0, [3.0, 5.0, 9.0], [1.0, 3.0, 7.5], [100.0, 1.0, 1.0])
    assert abs(k * (3.0 - c) - 1.0) < abs(1.0893 * (3.0 - 2.1475) - 1.0)


def test_a_middle_fill_gives_back_the_figures_and_keeps_one_noisy_fill_from_placing_the_knee():
    """With a fourth fill (middle), timings the model predicts still give back kv_bandwidth and
    kv_cached_bytes exactly (the line fitted to what the model adds beyond it, round after round).
    And the case that made it: steps that grow by a line from the short fill on (nothing cached)
    with the long fill's timing 10% fast. From the long and longer fills alone the fit puts a knee
    at megabytes of cache and predicts the middle fill's step too fast by more than the noise;
    with the middle fill it keeps every step within the noise."""
    profile = _toy()
    t = replace(_timings(profile, TRUE_HOST), fill_middle=520.0,
                decode_middle_s=_Model(profile, "f16").decode(TRUE_HOST, 1, 520.0))
    fitted = fit_host(profile, replace(TRUE_HOST, kv_cached_bytes=0.0, kv_bandwidth=1e9), "f16", t)
    assert fitted.kv_cached_bytes == pytest.approx(3e6, rel=1e-6)
    assert fitted.kv_bandwidth == pytest.approx(9e9, rel=1e-6)
    assert all(r == pytest.approx(1.0, rel=1e-6) for r in residuals(profile, fitted, "f16", t).values())

    linear = replace(TRUE_HOST, kv_cached_bytes=0.0, kv_bandwidth=2e9, attention_flops=1e15)
    m = _Model(profile, "f16")
    noisy = replace(_timings(profile, linear), decode_long_s=0.9 * m.decode(linear, 1, 1040.0),
                    fill_middle=520.0, decode_middle_s=m.decode(linear, 1, 520.0))
    three = fit_host(profile, linear, "f16", replace(noisy, fill_middle=None, decode_middle_s=None))
    four = fit_host(profile, linear, "f16", noisy)
    assert three.kv_cached_bytes > 1e6 and four.kv_cached_bytes < three.kv_cached_bytes / 2
    middle = {name: residuals(profile, fitted, "f16", noisy)["decode_middle"] for name, fitted in
              (("three", three), ("four", four))}
    assert middle["three"] > 1.1 > middle["four"] > 0.9


def test_steps_faster_than_the_given_bandwidth_allows_fit_the_engines_own():
    """The engine streamed its weights at 60 GB/s and had no per-step cost; the micro-benchmarks
    said 30. At 30 the model makes the whole step slower than measured whatever the overheads
    (they cannot go below 0): the fit takes the least bandwidth that reaches the step, 60, with
    the layer overhead refitted, and then reproduces every timing. Where the given bandwidth is
    enough (the per-step cost positive), it stays as given (the other tests)."""
    profile = _toy()
    true = replace(TRUE_HOST, memory_bandwidth=60e9, step_overhead_s=0.0, matmul_overhead_s=0.0,
                   decode_flops=400e9)     # one row reads its weights longer than it multiplies them
    t = _timings(profile, true)
    fitted = fit_host(profile, replace(true, memory_bandwidth=30e9), "f16", t)
    assert fitted.memory_bandwidth == pytest.approx(60e9, rel=1e-3)
    assert fitted.layer_overhead_s == pytest.approx(150e-6, rel=1e-3) and fitted.step_overhead_s < 1e-9
    assert all(r == pytest.approx(1.0, rel=1e-3) for r in residuals(profile, fitted, "f16", t).values())
    # a faster bandwidth given is not lowered: the per-step cost takes the difference
    faster = fit_host(profile, replace(true, memory_bandwidth=90e9), "f16", t)
    assert faster.memory_bandwidth == 90e9 and faster.step_overhead_s > 0


def test_the_batch_rate_fits_its_middle_and_long_fills_together():
    """With the batch timed at a middle fill too, its rate is the one that fits both of its fills
    best: timings the model predicts give it back exactly; a batch whose middle fill cost more than
    its long fill's line says (a steeper start) gets a lower rate than from the long fill alone,
    and its middle step is then predicted closer while its long one moves less than the middle's
    miss was."""
    profile = _toy()
    m = _Model(profile, "f16")
    host = replace(TRUE_HOST, kv_batch_bandwidth=4.5e9, kv_batch_rows=4)
    t = replace(_timings(profile, host), fill_middle=520.0, decode_middle_s=m.decode(host, 1, 520.0),
                decode_batch_middle_s=m.decode(host, 4, 520.0))
    fitted = fit_host(profile, replace(TRUE_HOST, kv_batch_bandwidth=0.0), "f16", t)
    assert fitted.kv_batch_bandwidth == pytest.approx(4.5e9, rel=1e-6)
    assert residuals(profile, fitted, "f16", t)["decode_batch_middle"] == pytest.approx(1.0, rel=1e-6)
    steep = replace(t, decode_batch_middle_s=t.decode_batch_s + 1.5 * (t.decode_batch_middle_s - t.decode_batch_s))
    both = fit_host(profile, TRUE_HOST, "f16", steep)
    long_only = fit_host(profile, TRUE_HOST, "f16", replace(steep, decode_batch_middle_s=None))
    assert long_only.kv_batch_bandwidth == pytest.approx(4.5e9, rel=1e-6)
    assert both.kv_batch_bandwidth < long_only.kv_batch_bandwidth
    r_both, r_long = (residuals(profile, f, "f16", steep) for f in (both, long_only))
    assert abs(r_both["decode_batch_middle"] - 1) < abs(r_long["decode_batch_middle"] - 1)
    assert abs(r_both["decode_batch_long"] - 1) < abs(r_long["decode_batch_middle"] - 1)
