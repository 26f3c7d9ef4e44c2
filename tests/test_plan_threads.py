"""`localrun plan`: the recommended thread count, bad input (one sentence, exit 2; 1 for a valid
plan that does not fit), and that planning never imports torch."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from layerplan.threads import recommend_threads
from localrun.cli.main import app

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))


@pytest.mark.parametrize("physical, logical, load, recommended, busy", [
    (8, 16, 0.1, 8, 0),      # idle: one thread per physical core, hyperthreads unused
    (8, 16, 2.6, 5, 3),      # about 3 cores taken by other work
    (8, 16, 2.4, 6, 2),
    (2, 2, 1.5, 1, 2),       # a busy 2-core machine: never below one thread
    (4, 4, float("nan"), 4, 0),
    (1, 1, 0.0, 1, 0),
])
def test_recommended_threads_by_hand(physical, logical, load, recommended, busy):
    advice = recommend_threads(physical, logical, load)
    assert (advice.recommended, advice.busy_cores) == (recommended, busy)
    assert str(recommended) in advice.reason


def test_plan_shows_threads_in_the_table_json_and_flags():
    args = ["plan", "llama2-7b", "--vram", "8GiB", "--ram", "32GiB"]
    data = json.loads(CliRunner().invoke(app, args + ["--json"], catch_exceptions=False).output.strip().splitlines()[-1])
    threads = data["threads"]
    assert 1 <= threads["recommended"] <= threads["physical_cores"] <= threads["logical_cores"]
    assert threads["recommended"] == max(1, threads["physical_cores"] - threads["busy_cores"])
    assert data["llama_cpp_flags"][-2:] == ["-t", str(threads["recommended"])]
    assert "Threads:" in CliRunner().invoke(app, args, catch_exceptions=False).output


def run_plan(*args, cwd=ROOT, env_home=None):
    code = ("import sys; from localrun.cli.main import main; "
            f"sys.argv = ['localrun', 'plan', *{list(args)!r}]; "
            "import atexit; atexit.register(lambda: print('TORCH', 'torch' in sys.modules)); main()")
    env = {"LOCALRUN_HOME": str(env_home or "/nonexistent"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env)


def test_bad_input_is_one_sentence_and_exit_2(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("these are not the weights you are looking for\n")
    cases = [
        ([str(not_gguf)], "not a valid GGUF file"),
        (["llama2-7b", "--vram", "256MiB"], "leaves nothing once the 512 MiB margin"),
        (["llama2-7b", "--vram", "9000TiB"], "more memory than any GPU has"),
        (["llama2-7b:f16", "--vram", "24GiB", "--ram", "32GiB", "--ctx", "4000000", "--parallel", "8"],
         "can never fit"),
    ]
    for args, message in cases:
        proc = run_plan(*args, env_home=tmp_path)
        errors = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, (args, proc.stderr)
        assert len(errors) == 1 and message in errors[0], (args, proc.stderr)


def test_a_valid_plan_that_does_not_fit_exits_1(tmp_path):
    proc = run_plan("llama2-7b:f16", "--vram", "24GiB", "--ram", "64GiB", "--ctx", "16384", "--parallel", "2",
                    "-ngl", "33", "--json", env_home=tmp_path)
    assert proc.returncode == 1
    assert json.loads(proc.stdout.splitlines()[-2])["fits"] is False


def test_plan_never_imports_torch(tiny_gguf, tmp_path):
    path = tiny_gguf("Q8_0")
    for extra in ([], ["--json"], ["--emit", "llama-server"], ["--prefer", "context", "--vram", "8GiB"]):
        proc = run_plan(str(path), *extra, env_home=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.strip().splitlines()[-1] == "TORCH False", (extra, proc.stdout[-500:])
