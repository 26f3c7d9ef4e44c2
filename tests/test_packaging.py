"""A non-editable install has what the code reads beside itself: the wheel built from this tree
holds the model catalog and the kernels' sources, and the catalog it ships is the one
`localrun models` and `localrun pull` read."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from localrun import models

ROOT = Path(__file__).resolve().parent.parent


def build_wheel(tmp_path: Path) -> zipfile.ZipFile:
    """The wheel of a copy of the tree (so the checkout gets no build/ or egg-info)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "_build", "*.egg-info", "*.gguf")
    for name in ("localrun", "layerplan"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(tmp_path / "dist")],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("localrun-*.whl")
    return zipfile.ZipFile(wheel)


def test_wheel_ships_the_catalog_and_kernel_sources(tmp_path):
    wheel = build_wheel(tmp_path)
    names = set(wheel.namelist())
    assert "localrun/catalog.json" in names
    assert json.loads(wheel.read("localrun/catalog.json")) == json.loads(models.CATALOG_PATH.read_text())
    sources = sorted(p.name for p in (ROOT / "localrun" / "kernels" / "csrc").iterdir()
                     if p.suffix in (".cpp", ".h"))
    assert sources and all(f"localrun/kernels/csrc/{name}" in names for name in sources)
    assert "localrun = localrun.cli.main:main" in wheel.read(
        next(n for n in names if n.endswith("entry_points.txt"))).decode()


def test_the_catalog_lives_in_the_package():
    assert models.CATALOG_PATH.parent == Path(models.__file__).resolve().parent
    assert models.DEFAULT_MODEL in models.catalog()
