"""llama.cpp's vocabulary load and tokenizer run on GGUF files in forked children, so that an
abort (GGML_ASSERT, a C++ exception through the C API) kills a child, not the test.

`VocabProbe()` starts one server process (this file run as a script) that imports llama.cpp
once and forks a child per file: a fork costs milliseconds where a fresh interpreter costs a
second, and a test tries hundreds of files. Each `probe(mode, path)` returns a `Probe`:

- mode "localrun": localrun's Tokenizer(path), then what localrun asks of it (encode with and
  without special tokens, decode, the piece table, the end-of-generation ids);
- mode "llama.cpp": the same through llama-cpp-python directly, with none of localrun's checks:
  the reference that says whether a file localrun refuses would have killed the process.

outcome is "ok", "refused" (localrun's UserError, detail its message), "error" (llama.cpp
refused the load itself, or localrun raised something else: detail says), or "signal" (the
child died: detail names the signal and ends with the child's stderr, where llama.cpp writes
its last words)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# texts every file is tokenized with: spaces, non-ASCII, special-token text, a NUL, nothing
TEXTS = ("hello world", "the fox and the dog", "Grüße, 世界! 🦊 naïve", "<|im_start|>user\nhi<|im_end|>\n",
         "<s> a\x00b </s>", "  two  spaces\tand a tab\n", "")


@dataclass(frozen=True)
class Probe:
    outcome: str
    detail: str = ""


class VocabProbe:
    def __init__(self):
        root = Path(__file__).resolve().parent.parent
        env = {**os.environ, "GGML_NO_BACKTRACE": "1",    # no gdb: the abort's own message is enough
               "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
        self._proc = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True, env=env, cwd=root)

    def probe(self, mode: str, path: str | os.PathLike) -> Probe:
        self._proc.stdin.write(f"{mode} {os.fspath(path)}\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        assert line, f"the probe server died (exit {self._proc.poll()})"
        return Probe(**json.loads(line))

    def close(self) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=30)


# --- the server (runs in its own process) ----------------------------------------------------

def _localrun(path: str) -> Probe:
    from localrun.errors import UserError
    from localrun.tokenizer import Tokenizer
    try:
        tok = Tokenizer(path)
    except UserError as e:
        return Probe("refused", str(e))
    for text in TEXTS:
        for add_special in (True, False):
            for parse_special in (True, False):
                tok.decode(tok.encode(text, add_special=add_special, parse_special=parse_special), special=True)
    _ = tok.eog_ids, tok.bos_id, tok.eos_id, tok.add_bos, tok.token_text(tok.n_vocab - 1)
    return Probe("ok", str(tok.n_vocab))


def _llama_cpp(path: str) -> Probe:
    import ctypes

    import llama_cpp
    from llama_cpp._internals import LlamaModel
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    try:
        model = LlamaModel(path_model=path, params=params, verbose=True)
    except Exception as e:
        return Probe("error", str(e))
    vocab, n_vocab = model.vocab, model.n_vocab()
    ids = (llama_cpp.llama_token * 4096)()
    for text in TEXTS:
        data = text.encode()
        for add_special in (True, False):
            for parse_special in (True, False):
                llama_cpp.llama_tokenize(vocab, data, len(data), ids, 4096, add_special, parse_special)
    buf = ctypes.create_string_buffer(256)
    for i in range(n_vocab):
        llama_cpp.llama_token_to_piece(vocab, i, buf, 256, 0, True)
        llama_cpp.llama_vocab_is_eog(vocab, i)
    return Probe("ok", str(n_vocab))


def _child(mode: str, path: str) -> Probe:
    try:
        return (_localrun if mode == "localrun" else _llama_cpp)(path)
    except BaseException as e:     # a traceback localrun let through is a finding, not a crash
        return Probe("error", f"{type(e).__name__}: {e}")


def _serve() -> None:
    import ctypes

    import resource

    import llama_cpp
    import localrun.tokenizer  # noqa: F401  (imported once, before the forks)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))     # an aborting child writes no core file

    @llama_cpp.llama_log_callback
    def quiet(level, text, user_data):   # llama.cpp's log, not its last words (those go to fd 2)
        pass

    llama_cpp.llama_log_set(quiet, ctypes.c_void_p(0))
    import llama_cpp._logger
    llama_cpp._logger.llama_log_callback = quiet     # what localrun's Tokenizer puts back after a load
    for line in sys.stdin:
        mode, path = line.rstrip("\n").split(" ", 1)
        with tempfile.TemporaryFile() as stderr:
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_end)
                os.dup2(stderr.fileno(), 1)    # stdout is the server's reply channel
                os.dup2(stderr.fileno(), 2)
                result = _child(mode, path)
                os.write(write_end, json.dumps(result.__dict__).encode())
                os._exit(0)
            os.close(write_end)
            with os.fdopen(read_end, "rb") as reply:
                data = reply.read()
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status):
                stderr.seek(0)
                tail = stderr.read().decode("utf-8", "replace")[-2000:]
                result = {"outcome": "signal", "detail": f"{signal.Signals(os.WTERMSIG(status)).name}: {tail}"}
            else:
                result = json.loads(data) if data else {"outcome": "error", "detail": f"exit {status}"}
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _serve()
