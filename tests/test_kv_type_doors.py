"""One vocabulary for the KV type behind every door (LLM, chat/generate/serve, plan): the engine's
names, llama.cpp's names as aliases where they mean the same layout of the engine's pool (q8_0 is
int8), one check (layerplan.kv_cache.engine_kv_type) with one sentence for a name the engine cannot
run, and one default (layerplan.kv_cache.default_kv_type)."""
from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from layerplan.kv_cache import DEFAULT_KV_TYPE, ENGINE_KV_TYPES, default_kv_type, engine_kv_type
from localrun.cli import options
from localrun.cli.main import app
from localrun.engine_config import EngineConfig
from localrun.errors import OptionError

ALIASES = [("q8_0", "int8"), ("f16", "f16"), ("fp16", "f16"), ("float16", "f16"), ("bfloat16", "bf16"),
           ("float32", "f32"), ("fp32", "f32"), ("fp8_e4m3", "fp8")] + [(name, name) for name in ENGINE_KV_TYPES]
REFUSED = ["q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "fp8_e5m2", "F16", "int4", ""]


@pytest.fixture(autouse=True)
def isolated_home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))


def sentence(option: str, value: str) -> str:
    return f"{option} takes f32, bf16, f16, int8, fp8, not {value!r}."


@pytest.mark.parametrize("name, engine_name", ALIASES)
def test_every_door_takes_the_same_names(name, engine_name):
    assert engine_kv_type(name) == engine_name
    assert EngineConfig(kv_type=name).kv_type == engine_name                       # LLM(kv_type=...)
    assert options.engine_config(kv_type=name).kv_type == engine_name              # chat, generate, serve
    result = CliRunner().invoke(app, ["plan", "llama2-7b:q4_0", "--ram", "64GiB", "--kv-type", name, "--json"],
                                catch_exceptions=False)
    assert json.loads(result.output.strip().splitlines()[-1])["kv_type"] == engine_name   # plan


@pytest.mark.parametrize("name", REFUSED)
def test_a_name_the_engine_cannot_run_is_one_sentence_from_every_door(name, tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError) as raised:
        engine_kv_type(name)
    assert str(raised.value) == sentence("kv_type", name)
    with pytest.raises(OptionError) as raised:
        EngineConfig(kv_type=name)                                     # LLM(kv_type=...)
    assert str(raised.value) == sentence("kv_type", name)
    from localrun.cli.main import main
    for command in (["chat", str(tmp_path / "missing.gguf")], ["serve", str(tmp_path / "missing.gguf")],
                    ["plan", "llama2-7b:q4_0"]):
        monkeypatch.setattr(sys, "argv", ["localrun", *command, "--kv-type", name])
        with pytest.raises(SystemExit) as exit:
            main()
        stderr = capsys.readouterr().err
        assert exit.value.code == 2 and stderr.strip().splitlines()[-1] == f"error: {sentence('--kv-type', name)}"


def test_a_plan_for_llama_cpp_takes_its_other_cache_types():
    """--emit llama-server plans llama.cpp's own cache, so its q4_0 is a name there."""
    result = CliRunner().invoke(app, ["plan", "llama2-7b:q4_0", "--ram", "64GiB", "--kv-type", "q4_0",
                                      "--emit", "llama-server"], catch_exceptions=False)
    assert "-ctk q4_0 -ctv q4_0" in result.output


def test_one_default():
    """None: f16 for a float32 model, as llama.cpp (the README's rule); a 16-bit model stores what
    it computes. The plan's default is the default compute dtype's."""
    import layerplan
    from localrun.api import default_dtype
    assert DEFAULT_KV_TYPE == default_kv_type(default_dtype()) == "f16"
    assert (default_kv_type("bfloat16"), default_kv_type("float16")) == ("bf16", "f16")
    assert layerplan.PlanSettings(n_ctx=1).kv_type == DEFAULT_KV_TYPE
    assert EngineConfig().kv_type is None          # resolved by the dtype, once: LLM, or LLMEngine alone


def test_the_engine_takes_the_default_for_its_model(tiny_gguf):
    from localrun.api import LLM
    for dtype, kv_type in (("float32", "f16"), ("bfloat16", "bf16")):
        llm = LLM(tiny_gguf("F32"), dtype=dtype, n_threads=1, n_ctx=64, n_parallel=1)
        assert llm.kv_type == llm.engine.kv_type == kv_type
