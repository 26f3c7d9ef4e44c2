"""`localrun chat` takes the sampling flags `generate` and the server take (--top-k, --top-p,
--min-p, --repeat-penalty) and hands them to the sampler: main() as the console script runs
the chat in this process, its turns read from stdin."""
import io
import sys

import pytest


def chat_replies(tiny_gguf, tmp_path, monkeypatch, capsys, *flags) -> list[str]:
    from localrun.cli.main import main
    lines = "say something\nand again\n/exit\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(lines))
    monkeypatch.setenv("LOCALRUN_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(sys, "argv", ["localrun", "chat", str(tiny_gguf("F32")), "-t", "1", "--ctx", "256", "-n", "12",
                                      "--no-disk-cache", *flags])
    try:
        main()
    except SystemExit as exit:
        assert exit.code in (None, 0), capsys.readouterr().err
    turns = capsys.readouterr().out.split("> ")         # each reply follows its prompt; the last prompt met /exit
    replies = [turn.rstrip("\n") for turn in turns[1:-1]]
    assert len(replies) == 2 and all(replies), turns
    return replies


def test_chat_top_k_one_is_greedy_at_any_seed(tiny_gguf, tmp_path, monkeypatch, capsys):
    """--top-k 1 leaves one candidate, so a hot temperature with any seed gives the greedy
    replies; without truncation two seeds give different ones (the flags reach the sampler)."""
    greedy = chat_replies(tiny_gguf, tmp_path, monkeypatch, capsys, "--temperature", "0")
    hot = ("--temperature", "2", "--top-p", "1", "--min-p", "0")
    for seed in ("1", "2"):
        assert chat_replies(tiny_gguf, tmp_path, monkeypatch, capsys, *hot, "--top-k", "1", "--seed", seed) == greedy
    free = [chat_replies(tiny_gguf, tmp_path, monkeypatch, capsys, *hot, "--top-k", "0", "--seed", seed)
            for seed in ("1", "2")]
    assert free[0] != free[1] and greedy not in free


@pytest.mark.parametrize("flag, value", [("--top-p", "0.0001"), ("--min-p", "1")])
def test_chat_narrow_nucleus_is_greedy(tiny_gguf, tmp_path, monkeypatch, capsys, flag, value):
    """A nucleus that keeps the top token alone (--top-p near 0, --min-p 1) is greedy too."""
    greedy = chat_replies(tiny_gguf, tmp_path, monkeypatch, capsys, "--temperature", "0")
    args = ["--temperature", "2", "--top-k", "0", "--top-p", "1", "--min-p", "0", "--seed", "3"]
    args[args.index(flag) + 1] = value
    assert chat_replies(tiny_gguf, tmp_path, monkeypatch, capsys, *args) == greedy


def test_chat_repeat_penalty_changes_the_greedy_reply(tiny_gguf, tmp_path, monkeypatch, capsys):
    """A strong --repeat-penalty reshapes even greedy replies (the tiny model repeats itself)."""
    plain = chat_replies(tiny_gguf, tmp_path, monkeypatch, capsys, "--temperature", "0")
    penalized = chat_replies(tiny_gguf, tmp_path, monkeypatch, capsys, "--temperature", "0", "--repeat-penalty", "5")
    assert penalized != plain
