"""One EngineConfig, checked once before anything loads: LLM's keywords, LLMEngine's names and
the CLI's flags all become one, and chat, generate and serve declare each shared flag once."""
from __future__ import annotations

import dataclasses

import pytest
import typer

from localrun.engine_config import DEFAULT_OUTPUT_RESERVE_TOKENS, DEFAULT_WATERMARK, EngineConfig
from localrun.errors import OptionError, UserError
from test_cli_errors import assert_user_error, run_cli


def test_defaults_and_normalised_values():
    config = EngineConfig(cache_ram="4GiB", kv_budget_bytes=1 << 20, cache_disk="1GiB", speculative="ngram")
    assert (config.cache_ram, config.kv_budget_bytes, config.cache_disk) == (4 << 30, 1 << 20, 1 << 30)
    assert (config.output_reserve_tokens, config.kv_watermark) == (DEFAULT_OUTPUT_RESERVE_TOKENS, DEFAULT_WATERMARK)
    assert EngineConfig(n_ctx=0, n_threads=0) == EngineConfig()      # 0: the default, as llama.cpp's -c 0 -t 0


@pytest.mark.parametrize("options, fragment", [
    ({"n_ctx": 1}, "n_ctx"), ({"n_threads": -1}, "n_threads"), ({"n_parallel": 0}, "n_parallel"),
    ({"n_keep": -1}, "n_keep"), ({"cache_ram": "lots"}, "not a size"), ({"cache_ram": -1}, "non-negative"),
    ({"cache_disk": 0}, "positive"), ({"kv_budget_bytes": "2 apples"}, "not a size"),
    ({"n_gpu_layers": "most"}, "n_gpu_layers takes 'auto'"), ({"scheduling": "lifo"}, "scheduling takes fcfs"),
    ({"kv_watermark": 1.5}, "kv_watermark must be"), ({"output_reserve_tokens": -1}, "output_reserve_tokens"),
    ({"n_parallel": 64, "max_num_batched_tokens": 16}, "max_num_batched_tokens"),
    ({"speculative": "self:two"}, "self:N"), ({"kv_type": "q4_0"}, "kv_type takes f32, bf16, f16, int8, fp8,"),
    ({"kv_type": "F16"}, "kv_type takes"), ({"dtype": "float64"}, "dtype takes float32, bfloat16, float16,"),
    ({"dtype": "bf16"}, "dtype takes")])
def test_each_option_is_checked_once_with_one_sentence(options, fragment):
    """The sentence starts with the option's name (the scheduler's checks too, under this config's
    names: scheduling, not policy), so the CLI can say the flag instead."""
    with pytest.raises(OptionError, match=fragment) as raised:
        EngineConfig(**options)
    option = raised.value.option
    assert str(raised.value).startswith(option) and option in EngineConfig.__dataclass_fields__


def test_kv_type_and_dtype_take_what_the_engine_runs():
    import torch
    for kv_type in ("f32", "bf16", "f16", "int8", "fp8"):
        assert EngineConfig(kv_type=kv_type).kv_type == kv_type
    for dtype in ("float32", "bfloat16", "float16", torch.float32, torch.bfloat16, torch.float16):
        assert EngineConfig(dtype=dtype).dtype == dtype
    with pytest.raises(OptionError, match="dtype takes"):
        EngineConfig(dtype=torch.float64)


def test_replace_checks_again():
    with pytest.raises(UserError, match="n_parallel"):
        dataclasses.replace(EngineConfig(), n_parallel=0)


def test_engine_names():
    config = EngineConfig.for_engine(max_model_len=96, policy="cache_aware", watermark=0.0, ram_cache_bytes=0)
    assert (config.n_ctx, config.scheduling, config.kv_watermark, config.cache_ram) == (96, "cache_aware", 0.0, 0)
    assert config.n_parallel == 16                      # LLMEngine(model) alone batches 16 sequences
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineConfig.for_engine(max_num_seq=4)


def test_llm_checks_options_before_it_looks_at_the_model(tmp_path):
    from localrun.api import LLM
    with pytest.raises(UserError, match="n_parallel"):
        LLM(tmp_path / "missing.gguf", n_parallel=0)
    with pytest.raises(TypeError):
        LLM(tmp_path / "missing.gguf", verbose=True)     # never read: gone


def test_llm_takes_a_config_keywords_or_both(tiny_gguf):
    from localrun.api import LLM
    path = tiny_gguf("F32")
    by_keywords = LLM(path, n_threads=1, n_ctx=64, n_parallel=2)
    by_config = LLM(path, EngineConfig(n_threads=1, n_ctx=64, n_parallel=2))
    both = LLM(path, EngineConfig(n_threads=1, n_ctx=64, n_parallel=8), n_parallel=2)
    assert by_keywords.engine_config == by_config.engine_config == both.engine_config
    engine = both.engine
    assert engine.engine_config is both.engine_config and engine.scheduler.config.max_num_seqs == 2
    assert engine.max_model_len == both.n_ctx == 64


def test_the_engine_takes_a_config_or_its_own_names_not_both(tiny_gguf):
    from localrun.api import LLM
    from localrun.engine.llm_engine import LLMEngine
    model = LLM(tiny_gguf("F32"), n_threads=1, n_ctx=64).model
    assert LLMEngine(model, EngineConfig(n_parallel=3)).scheduler.config.max_num_seqs == 3
    assert LLMEngine(model, max_num_seqs=5).scheduler.config.max_num_seqs == 5
    with pytest.raises(TypeError, match="max_num_seqs"):
        LLMEngine(model, EngineConfig(), max_num_seqs=5)


SHARED_FLAGS = ("--ctx", "--threads", "--kv-type", "--gpu-layers", "--draft-model", "--spec", "--draft-max")


def test_chat_generate_and_serve_declare_the_shared_flags_once():
    from localrun.cli.main import app
    commands = typer.main.get_command(app).commands
    for flag in SHARED_FLAGS + ("--cache-dir", "--no-disk-cache", "--cache-disk", "--cache-ram"):
        owners = ["chat", "serve"] + (["generate"] if flag in SHARED_FLAGS else [])
        options = [next(p for p in commands[name].params if flag in p.opts) for name in owners]
        assert len({(tuple(o.opts), o.default, o.help) for o in options}) == 1, flag


def test_a_bad_flag_is_refused_before_the_model_is_looked_up(tmp_path):
    missing = str(tmp_path / "missing.gguf")
    assert_user_error(run_cli("generate", missing, "-p", "hi", "--ctx", "1"), "--ctx must be")
    assert_user_error(run_cli("chat", missing, "--cache-ram", "lots"), "not a size")
    assert_user_error(run_cli("serve", missing, "--kv-budget", "lots", "--port", "18998"), "not a size")


def test_each_renamed_option_names_a_flag_the_commands_take():
    """A bad value's sentence names the flag (FLAGS, else the option's name in dashes): each such
    flag exists, for EngineConfig's fields, generate's sampling options and plan's --n-cpu-moe."""
    from localrun.cli.main import app
    from localrun.cli.options import FLAGS, flag_of
    flags = {opt for command in typer.main.get_command(app).commands.values() for p in command.params
             for opt in p.opts}
    assert set(FLAGS) <= set(EngineConfig.__dataclass_fields__) and set(FLAGS.values()) <= flags
    for option in ("cache_dir", "cache_disk", "cache_ram", "kv_type", "max_tokens", "temperature", "top_k",
                   "top_p", "min_p", "repeat_penalty", "seed", "n_cpu_moe"):
        assert flag_of(option) in flags, option
