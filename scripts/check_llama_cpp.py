"""Set-up check: llama.cpp evaluates one token of the default model in a child process.
An import alone is not enough: a build with the wrong CPU features dies with SIGILL only at
the first evaluation."""
import subprocess
import sys

from localrun.models import DEFAULT_MODEL, pull

CHILD = """
import sys, llama_cpp
llm = llama_cpp.Llama(sys.argv[1], n_ctx=64, n_threads=1, verbose=False)
llm.eval(llm.tokenize(b"Hello"))
print("llama.cpp ok")
"""

path = pull(DEFAULT_MODEL, quiet=True)
proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True)
if proc.returncode != 0:
    why = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit code {proc.returncode}"
    sys.stderr.write(f"llama.cpp failed to evaluate a token ({why}).\n{proc.stderr[-2000:]}")
    sys.exit(1)
print(proc.stdout.strip())
