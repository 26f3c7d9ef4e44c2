"""`localrun tune`: the sweep measures every setting, the choice follows its rule, and the
profile round-trips through $LOCALRUN_HOME for chat and serve."""
from __future__ import annotations

import json

from typer.testing import CliRunner

from localrun.cli.main import app
from localrun.tune import TuneRow, best_row, load_profile, profile_path, save_profile, sweep


def row(threads, chunk, prefill, decode):
    return TuneRow(0, threads, chunk, prefill, decode, None, None)


def test_best_row_prefers_decode_then_prefill():
    rows = [row(1, 64, 900.0, 50.0), row(2, 64, 500.0, 80.0), row(2, 128, 700.0, 79.0), row(4, 64, 990.0, 60.0)]
    assert best_row(rows) == rows[2]          # within 3% of the best decode, faster prefill


def test_sweep_and_profile_round_trip(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path))
    path = tiny_gguf("Q4_0")
    assert load_profile(path) == {}
    steps = []
    rows = list(sweep(path, threads=[1], chunks=[8, 32], gpu_layers=[0], prompt_tokens=32, gen_tokens=2,
                      on_step=steps.append))
    assert [(r.n_threads, r.chunk) for r in rows] == [(1, 8), (1, 32)]
    assert all(r.prefill_tok_s > 0 and r.decode_tok_s > 0 for r in rows) and steps
    assert rows[0].decode_tok_s == rows[1].decode_tok_s         # decode is timed once per thread count
    saved = save_profile(path, best_row(rows), rows, machine="test")
    assert saved == profile_path(path) and saved.is_relative_to(tmp_path)
    assert load_profile(path) == {"n_threads": 1, "n_gpu_layers": 0, "max_num_batched_tokens": best_row(rows).chunk}
    saved.write_text("{not json")
    assert load_profile(path) == {}


def test_cli_tune_json(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path))
    path = tiny_gguf("F32")
    result = CliRunner().invoke(app, ["tune", str(path), "-t", "1", "--chunks", "16", "--prompt-tokens", "16",
                                      "--gen-tokens", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output.strip().splitlines()[-1])
    assert len(data["rows"]) == 1 and data["best"]["chunk"] == 16
    assert load_profile(path)["n_threads"] == 1
    bad = CliRunner().invoke(app, ["tune", str(path), "--chunks", "many"])
    assert bad.exit_code != 0 and "numbers separated by commas" in str(bad.exception)


def test_apply_profile_fills_only_what_the_user_left_unset(tiny_gguf, tmp_path, monkeypatch):
    from localrun.tune import apply_profile
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path))
    model = tiny_gguf("F32")
    assert apply_profile(model, None, {"n_gpu_layers": "auto"}) == (None, {"n_gpu_layers": "auto"}, False)
    best = TuneRow(n_gpu_layers=0, n_threads=1, chunk=256, prefill_tok_s=10.0, decode_tok_s=5.0,
                   predicted_prefill_tok_s=None, predicted_decode_tok_s=None)
    save_profile(model, best, [best], "test machine")
    threads, options, used = apply_profile(model, None, {"n_gpu_layers": "auto"})
    assert used and threads == 1 and options == {"n_gpu_layers": 0, "max_num_batched_tokens": 256}
    threads, options, _ = apply_profile(model, 2, {"n_gpu_layers": 3, "max_num_batched_tokens": 64})
    assert threads == 2 and options == {"n_gpu_layers": 3, "max_num_batched_tokens": 64}


def test_tune_times_the_engine_chat_and_serve_run(tiny_gguf, tmp_path, monkeypatch):
    """The rows are engine steps (LLMEngine.step), not the reference runner's forward."""
    from localrun.engine.llm_engine import LLMEngine
    from localrun.runner import SequenceRunner
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path))
    calls = {"engine": 0, "runner": 0}
    step, forward = LLMEngine.step, SequenceRunner.forward

    def counted_step(self, *a, **k):
        calls["engine"] += 1
        return step(self, *a, **k)

    def counted_forward(self, *a, **k):
        calls["runner"] += 1
        return forward(self, *a, **k)
    monkeypatch.setattr(LLMEngine, "step", counted_step)
    monkeypatch.setattr(SequenceRunner, "forward", counted_forward)
    rows = list(sweep(tiny_gguf("Q4_0"), threads=[1], chunks=[8, 32], gpu_layers=[0], prompt_tokens=32, gen_tokens=3))
    assert len(rows) == 2 and calls["runner"] == 0
    # per round and chunk: the prompt's steps (4 of 8 tokens, or 1 of 32) and 3 decode steps
    assert calls["engine"] >= 3 * ((4 + 3) + (1 + 3))


def test_only_the_calibrated_thread_count_is_predicted(tiny_gguf, tmp_path, monkeypatch):
    from layerplan import calibrate
    from localrun.tune import Forecast
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path))
    path = tiny_gguf("Q4_0")
    cal = calibrate.Calibration(fingerprint="x", host_bandwidth=20e9, host_flops=1e11, host_matmul_overhead_s=1e-5,
                                backend="engine", threads=1, engine_reference_s=1e-3)
    monkeypatch.setattr(calibrate, "load", lambda machine, cache_dir=None, model=None, engine_build=None: cal)
    forecast = Forecast(path, 32, 2)
    rows = list(sweep(path, threads=[1, 2], chunks=[8, 32], gpu_layers=[0], prompt_tokens=32, gen_tokens=2,
                      forecast=forecast))
    assert forecast.threads == 1
    predicted = {(r.n_threads, r.chunk): (r.predicted_prefill_tok_s, r.predicted_decode_tok_s) for r in rows}
    assert predicted[(2, 8)] == predicted[(2, 32)] == (None, None)
    assert all(v > 0 for v in predicted[(1, 8)] + predicted[(1, 32)])
    assert predicted[(1, 8)][0] < predicted[(1, 32)][0]       # 4 prompt steps of 8 cost more than one of 32
    assert forecast.host_speed is not None and forecast.host_speed > 0   # the reference step timed again


def test_without_a_calibration_nothing_is_predicted(tiny_gguf, tmp_path, monkeypatch):
    from layerplan import calibrate
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path))
    monkeypatch.setattr(calibrate, "load", lambda machine, cache_dir=None, model=None, engine_build=None: None)
    rows = list(sweep(tiny_gguf("Q4_0"), threads=[1], chunks=[16], gpu_layers=[0], prompt_tokens=16, gen_tokens=2))
    assert [(r.predicted_prefill_tok_s, r.predicted_decode_tok_s) for r in rows] == [(None, None)]
