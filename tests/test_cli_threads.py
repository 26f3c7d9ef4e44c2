"""chat and serve (cli.options.load_llm) take layerplan's thread advice when neither -t nor a
tuned profile sets the threads, and -t always wins; a context beyond the trained one gets one
warning line."""
from __future__ import annotations

import pytest

from layerplan import threads as layerplan_threads
from localrun.cli import options


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))     # no tuned profile


@pytest.mark.parametrize("flag, expected", [(None, 1), (3, 3)])
def test_threads_follow_the_advice_unless_given(tiny_gguf, monkeypatch, flag, expected):
    advice = layerplan_threads.recommend_threads(physical_cores=4, logical_cores=8, load_1m=2.6)
    assert advice.recommended == 1                       # 4 cores, 3 busy
    monkeypatch.setattr(layerplan_threads, "advise_threads", lambda: advice)
    llm = options.load_llm(str(tiny_gguf("F32")), options.engine_config(threads=flag))
    try:
        assert llm.n_threads == expected
    finally:
        llm.close()


def test_the_advice_does_not_count_a_load_that_has_ended(monkeypatch):
    """A 1-minute load of 2 left by a process that has stopped: the CPU is idle now, so every
    core is advised; while it runs, the busy cores are kept free."""
    import psutil
    monkeypatch.setattr(psutil, "cpu_count", lambda logical=True: 4)
    monkeypatch.setattr(psutil, "getloadavg", lambda: (2.0, 1.0, 0.5))
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 3.0)       # idle now
    assert layerplan_threads.advise_threads().recommended == 4
    monkeypatch.setattr(psutil, "cpu_percent", lambda interval=None: 50.0)      # 2 of 4 busy now
    assert layerplan_threads.advise_threads().recommended == 2


@pytest.mark.parametrize("ctx, warned", [(128, True), (64, False)])
def test_a_context_beyond_the_trained_one_is_accepted_with_a_warning(tiny_gguf, capsys, ctx, warned):
    llm = options.load_llm(str(tiny_gguf("F32", context_length=64)), options.engine_config(ctx=ctx, threads=1))
    try:
        assert llm.n_ctx == ctx
        stderr = capsys.readouterr().err
        assert ("warning: the context of 128 tokens exceeds the 64 this model was trained for" in stderr) == warned
        assert (llm.context_warning is not None) == warned
    finally:
        llm.close()
