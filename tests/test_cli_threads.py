"""chat and serve (cli_options.load_llm) take layerplan's thread advice when neither -t nor a
tuned profile sets the threads, and -t always wins."""
from __future__ import annotations

import pytest

from layerplan import threads as layerplan_threads
from localrun import cli_options


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))     # no tuned profile


@pytest.mark.parametrize("flag, expected", [(None, 1), (3, 3)])
def test_threads_follow_the_advice_unless_given(tiny_gguf, monkeypatch, flag, expected):
    advice = layerplan_threads.recommend_threads(physical_cores=4, logical_cores=8, load_1m=2.6)
    assert advice.recommended == 1                       # 4 cores, 3 busy
    monkeypatch.setattr(layerplan_threads, "advise_threads", lambda: advice)
    llm = cli_options.load_llm(str(tiny_gguf("F32")), cli_options.engine_config(threads=flag))
    try:
        assert llm.n_threads == expected
    finally:
        llm.close()
