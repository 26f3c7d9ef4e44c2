"""Bad input on the command line: one clear sentence on stderr, exit code 2, no traceback."""
import subprocess
import sys

import pytest

from synthetic_gguf import write_tiny_llama


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "localrun.cli", *args], capture_output=True, text=True,
                          timeout=120)


def assert_user_error(proc, fragment):
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr and fragment in proc.stderr, proc.stderr
    assert proc.stderr.strip().startswith("error:")


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    good = write_tiny_llama(root / "good.gguf", tensor_type="F32")
    data = good.read_bytes()
    (root / "truncated.gguf").write_bytes(data[:len(data) // 2])
    (root / "header-cut.gguf").write_bytes(data[:200])
    (root / "text.gguf").write_text("this is not a model\n" * 10)
    (root / "empty.gguf").write_bytes(b"")
    arch = data.replace(b"llama", b"mamba", 1)           # general.architecture value
    (root / "arch.gguf").write_bytes(arch)
    return root


@pytest.mark.parametrize("name,fragment", [
    ("missing.gguf", "no such file"),
    ("truncated.gguf", "truncated"),
    ("header-cut.gguf", "not a valid GGUF"),
    ("text.gguf", "not a valid GGUF"),
    ("empty.gguf", "not a valid GGUF"),
    ("arch.gguf", "architecture 'mamba' is not supported"),
])
def test_bad_model_files(bad_files, name, fragment):
    assert_user_error(run_cli("info", str(bad_files / name)), fragment)
    assert_user_error(run_cli("generate", str(bad_files / name), "-p", "hi"), fragment)


def test_unsupported_tensor_type(tmp_path):
    path = write_tiny_llama(tmp_path / "iq.gguf", tensor_type="F32")
    data = bytearray(path.read_bytes())
    # retype the first 2-D tensor's info to IQ2_XXS (id 16) in place: find its name, skip dims
    import struct
    from layerplan.gguf_header import read_header
    info = next(t for t in read_header(path).tensors if t.name == "blk.0.attn_q.weight")
    key = info.name.encode()
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    assert struct.unpack_from("<I", data, type_at)[0] == 0
    struct.pack_into("<I", data, type_at, 16)
    path.write_bytes(bytes(data))
    proc = run_cli("info", str(path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr


def test_unknown_catalog_name():
    assert_user_error(run_cli("pull", "no-such-model"), "unknown model")


def test_directory_is_not_a_model(tmp_path):
    assert_user_error(run_cli("info", str(tmp_path)), "directory")
