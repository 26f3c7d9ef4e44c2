"""The admission options reach the engine from LLM and from `localrun serve`, and bad values
are refused in one sentence before the model loads."""
from __future__ import annotations

import pytest

from localrun.api import LLM
from localrun.engine.llm_engine import DEFAULT_OUTPUT_RESERVE_TOKENS, DEFAULT_WATERMARK
from localrun.errors import UserError
from test_cli_errors import assert_user_error, run_cli


def test_llm_passes_admission_options_to_the_engine(tiny_gguf):
    config = LLM(tiny_gguf("F32"), n_threads=1).engine.scheduler.config
    assert (config.policy, config.output_reserve_tokens, config.watermark) == \
        ("fcfs", DEFAULT_OUTPUT_RESERVE_TOKENS, DEFAULT_WATERMARK)
    config = LLM(tiny_gguf("F32"), n_threads=1, scheduling="cache_aware", output_reserve_tokens=0,
                 kv_watermark=0.0).engine.scheduler.config
    assert (config.policy, config.output_reserve_tokens, config.watermark) == ("cache_aware", 0, 0.0)


@pytest.mark.parametrize("options, fragment", [({"scheduling": "lifo"}, "scheduling takes fcfs or cache_aware"),
                                               ({"output_reserve_tokens": -1}, "output_reserve_tokens"),
                                               ({"kv_watermark": 1.5}, "watermark")])
def test_bad_admission_options_are_user_errors(tiny_gguf, options, fragment):
    with pytest.raises(UserError, match=fragment):
        LLM(tiny_gguf("F32"), n_threads=1, **options)


def test_serve_refuses_an_unknown_schedule(tiny_gguf):
    assert_user_error(run_cli("serve", str(tiny_gguf("F32")), "--schedule", "lifo", "--port", "18999"),
                      "--schedule takes fcfs or cache_aware")
