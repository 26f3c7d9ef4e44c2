"""The vocabulary as llama.cpp will read it (issue 76): a file that llama.cpp's vocab-only load
or its tokenizer would abort on is one sentence from localrun, and the reference for "would
abort" is llama.cpp itself, run on the same file in a forked child (tests/vocab_probe.py)."""
from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys

import pytest
from gguf.gguf_writer import GGUFValue

from localrun.errors import UserError
from localrun.tokenizer import Tokenizer
from localrun.vocab_check import as_llama_reads
from synthetic_gguf import tiny_bpe_vocab, write_tiny_llama
from vocab_gguf import T, bpe_tokenizer, spm_tokenizer, write_vocab_gguf
from vocab_probe import VocabProbe

TOKENS = "tokenizer.ggml.tokens"


@pytest.fixture(scope="module")
def probe():
    p = VocabProbe()
    yield p
    p.close()


def with_tokens(tokenizer: dict, **texts: str) -> dict:
    """tokenizer with the texts of some tokens replaced: with_tokens(t, **{"300": "a\\0b"})."""
    tokens = list(tokenizer[TOKENS])
    for i, text in texts.items():
        tokens[int(i)] = text
    return {**tokenizer, TOKENS: tokens}


def small_bpe(n_tokens: int = 10, **keys) -> dict:
    """A BPE vocabulary of fewer tokens than llama.cpp's default BOS/EOS id (11)."""
    tokens = ["<|endoftext|>", "h", "e", "l", "o", "Ġ", "w", "r", "d", "he"][:n_tokens]
    return {**bpe_tokenizer(), TOKENS: tokens, "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
            "tokenizer.ggml.merges": ["h e"], "tokenizer.ggml.bos_token_id": None,
            "tokenizer.ggml.eos_token_id": None, **keys}


def drop_none(tokenizer: dict) -> dict:
    return {k: v for k, v in tokenizer.items() if v is not None}


BPE, SPM = bpe_tokenizer(), spm_tokenizer()
BPE_TYPES = BPE["tokenizer.ggml.token_type"]
SPM_BYTE_C3 = 3 + 0xC3          # spm_tokenizer's ids: 3 specials, then <0x00>..<0xFF>

# (name, tokenizer keys, a fragment of localrun's one sentence, what llama.cpp does with the file
# unchecked: "signal" where it aborts the process)
CASES = [
    ("nul-makes-duplicate", with_tokens(BPE, **{"300": "a\x00b"}),
     "lists the token 'a' twice (again at id 300), reading each text up to its first NUL byte", "signal"),
    ("nul-first-is-empty", with_tokens(BPE, **{"300": "\x00x", "301": "[EMPTY_300]"}),
     "lists the token '[EMPTY_300]' twice (again at id 301)", "signal"),
    ("empty-text", with_tokens(BPE, **{"300": "", "301": "[EMPTY_300]"}),
     "lists the token '[EMPTY_300]' twice (again at id 301)", "signal"),
    ("gpt2-read-as-llama", {**BPE, "tokenizer.ggml.model": "llama"},
     "the SentencePiece vocabulary (tokenizer model 'llama') lacks the byte token <0x00> and", "signal"),
    ("spm-byte-token-missing", with_tokens(SPM, **{str(SPM_BYTE_C3): "<0xc3>"}),
     "lacks the byte token <0xC3>, which llama.cpp needs", "signal"),
    ("spm-without-scores", {**SPM, "tokenizer.ggml.scores": None},
     "has no token scores (tokenizer.ggml.scores)", "ok"),
    ("bpe-adds-bos-it-lacks", small_bpe(**{"tokenizer.ggml.add_bos_token": True}),
     "the vocabulary has no BOS token ('tokenizer.ggml.bos_token_id' names none of its 10 tokens)", "signal"),
    ("bpe-bos-id-out-of-range", small_bpe(**{"tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.bos_token_id": 50}),
     "the vocabulary has no BOS token", "signal"),
    ("llama3-pre-adds-bos", small_bpe(**{"tokenizer.ggml.pre": "llama3", "tokenizer.ggml.add_bos_token": None}),
     "the vocabulary has no BOS token", "signal"),
    ("bpe-adds-eos-it-lacks", small_bpe(**{"tokenizer.ggml.add_eos_token": True}),
     "the vocabulary has no EOS token", "signal"),
    ("bpe-whitespace-pre-tokenizer", {**BPE, "tokenizer.ggml.pre": "whitespace"},   # found by the fuzz test
     "the BPE pre-tokenizer 'whitespace' leaves spaces inside words", "signal"),
    ("bpe-byte-token-spelled-short", {**BPE, "tokenizer.ggml.token_type": [3, 3, 3, 6] + BPE_TYPES[4:]},
     "byte token 3 is spelled 'Ā', not <0xHH>", "error"),
    ("bos-id-as-int32", {**BPE, "tokenizer.ggml.bos_token_id": GGUFValue(1, T.INT32)},
     "'tokenizer.ggml.bos_token_id' is not a uint32, the type llama.cpp reads it as", "error"),
    ("bpe-without-merges", {**BPE, "tokenizer.ggml.merges": None},
     "the BPE vocabulary (tokenizer model 'gpt2') has no merges", "error"),
    ("unknown-pre-tokenizer", {**BPE, "tokenizer.ggml.pre": "nonesuch"},
     "llama.cpp could not load the vocabulary (error loading model vocabulary: unknown pre-tokenizer type: "
     "'nonesuch')", "error"),
]


@pytest.fixture(scope="module")
def case_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    return {name: write_vocab_gguf(root / f"{name}.gguf", drop_none(keys)) for name, keys, _, _ in CASES}


@pytest.mark.parametrize("name,fragment,reference", [(n, f, r) for n, _, f, r in CASES], ids=[c[0] for c in CASES])
def test_refused_in_one_sentence_where_llama_cpp_would_abort(probe, case_files, name, fragment, reference):
    path = case_files[name]
    unchecked = probe.probe("llama.cpp", path)
    assert unchecked.outcome == reference, unchecked
    ours = probe.probe("localrun", path)
    assert ours.outcome == "refused", ours
    assert fragment in ours.detail and "\n" not in ours.detail, ours.detail
    assert ours.detail.startswith(f"{path}: ")


@pytest.mark.parametrize("name,tokenizer", [("bpe", BPE), ("spm", SPM)])
def test_valid_vocabularies_load_and_tokenize(probe, tmp_path, name, tokenizer):
    path = write_vocab_gguf(tmp_path / f"{name}.gguf", tokenizer)
    assert probe.probe("llama.cpp", path).outcome == "ok"
    assert probe.probe("localrun", path) == probe.probe("llama.cpp", path)   # ("ok", n_vocab)
    tok = Tokenizer(path)
    for text in ("hello world", "the fox and the dog", "Grüße, 世界! 🦊", "a\x00b"):
        # SentencePiece adds a space before the text (and its first piece keeps it)
        assert tok.decode(tok.encode(text, add_special=False)) in (text, " " + text)


def test_sentencepiece_falls_back_to_bytes_for_uncovered_text(tmp_path):
    tok = Tokenizer(write_vocab_gguf(tmp_path / "spm.gguf", SPM))
    space = SPM[TOKENS].index("▁")
    assert tok.encode("世", add_special=False) == [space, 3 + 0xE4, 3 + 0xB8, 3 + 0x96]   # "世" is E4 B8 96


def test_texts_are_read_as_c_strings():
    assert as_llama_reads(b"a\x00b", 7) == b"a"
    assert as_llama_reads(b"\x00b", 7) == b"[EMPTY_7]" == as_llama_reads(b"", 7)
    assert as_llama_reads(b"<0x41>", 7) == b"<0x41>"


def run_cli(*commands: list[str]) -> list[tuple[int, str]]:
    """(exit code, stderr) of each `localrun` command, run side by side."""
    procs = [subprocess.Popen([sys.executable, "-m", "localrun.cli", *args], stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for args in commands]
    results = []
    for proc in procs:
        _, stderr = proc.communicate(timeout=120)
        results.append((proc.returncode, stderr))
    return results


@pytest.mark.parametrize("metadata,fragment", [
    ({TOKENS: (lambda t: t[:300] + ["a\x00b"] + t[301:])(tiny_bpe_vocab(320)[0])}, "lists the token 'a' twice"),
    ({"tokenizer.ggml.model": "llama"}, "lacks the byte token <0x00>"),
], ids=["nul-inside-token", "gpt2-changed-to-llama"])
def test_issue_cases_through_info_generate_and_serve(tmp_path, metadata, fragment):
    """The two files of issue 76, full models: `info`, `generate` and `serve` (which refuses to
    start) exit 2 with one sentence."""
    path = write_tiny_llama(tmp_path / "model.gguf", tensor_type="F32", n_layers=1, n_embd=64, n_head=2,
                            n_head_kv=1, n_ff=128, metadata=metadata)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    commands = [["info", str(path)], ["generate", str(path), "-p", "hello world", "-n", "2"],
                ["serve", str(path), "--port", str(port)]]
    for args, (code, stderr) in zip(commands, run_cli(*commands)):
        assert code == 2, (args, code, stderr)
        assert fragment in stderr and "Traceback" not in stderr, stderr
        assert stderr.strip().startswith("error:") and len(stderr.strip().splitlines()) == 1, stderr


def test_a_native_abort_during_the_load_still_says_why(tmp_path):
    """Were a file to get past the checks, llama.cpp's own last words reach stderr: the load
    leaves fd 2 alone (issue 76: the process used to die without a word)."""
    path = write_vocab_gguf(tmp_path / "nul.gguf", with_tokens(BPE, **{"300": "a\x00b"}))
    code = ("import localrun.tokenizer as t; t.check_vocabulary = lambda header: None; "
            f"t.Tokenizer({str(path)!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "GGML_NO_BACKTRACE": "1"},
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))   # no core file
    assert proc.returncode < 0, (proc.returncode, proc.stderr)
    assert "GGML_ASSERT(id_to_token.size() == token_to_id.size())" in proc.stderr, proc.stderr


def test_load_errors_carry_llama_cpps_reason(tmp_path):
    path = write_vocab_gguf(tmp_path / "pre.gguf", {**BPE, "tokenizer.ggml.pre": "nonesuch"})
    with pytest.raises(UserError, match=r"unknown pre-tokenizer type: 'nonesuch'\)$"):
        Tokenizer(path)


def test_a_lone_surrogate_is_one_sentence(tmp_path):
    tok = Tokenizer(write_vocab_gguf(tmp_path / "bpe.gguf", BPE))
    with pytest.raises(UserError, match="not valid Unicode"):
        tok.encode("a\ud800b")


@pytest.mark.parametrize("keys,name", [({"tokenizer.ggml.add_bos_token": True}, "BOS"),
                                       ({"tokenizer.ggml.add_eos_token": True}, "EOS")])
def test_the_loaded_vocabulary_is_asked_too(tmp_path, monkeypatch, keys, name):
    """Past the header check (here switched off), the Tokenizer asks llama.cpp's loaded
    vocabulary whether it adds a BOS/EOS token it lacks, before any text reaches llama_tokenize."""
    import localrun.tokenizer
    monkeypatch.setattr(localrun.tokenizer, "check_vocabulary", lambda header: None)
    path = write_vocab_gguf(tmp_path / "small.gguf", drop_none(small_bpe(**keys)))
    with pytest.raises(UserError, match=f"the vocabulary has no {name} token, yet llama.cpp is to add one"):
        Tokenizer(path)
