"""$LOCALRUN_HOME is resolved in one place (layerplan.home) and every cache under it follows:
unset or empty means ~/.cache/localrun, a relative path is made absolute."""
import importlib

import pytest

from layerplan.calibrate import default_cache_dir
from layerplan.home import localrun_home
from localrun.models import models_dir

build = importlib.import_module("localrun.kernels.build")     # the package exports a function of that name


@pytest.mark.parametrize("value", [None, ""])
def test_unset_or_empty_is_the_default(monkeypatch, tmp_path, value):
    monkeypatch.setenv("HOME", str(tmp_path))
    if value is None:
        monkeypatch.delenv("LOCALRUN_HOME", raising=False)
    else:
        monkeypatch.setenv("LOCALRUN_HOME", value)
    assert localrun_home() == (tmp_path / ".cache" / "localrun").resolve()


def test_every_cache_lies_under_one_absolute_home(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LOCALRUN_HOME", "relative-home")
    home = (tmp_path / "relative-home").resolve()
    assert localrun_home() == home and home.is_absolute()
    assert models_dir() == home / "models"
    assert default_cache_dir() == home / "layerplan"
    monkeypatch.setattr(build.os, "access", lambda path, mode: False)    # an installed, read-only package
    assert build.library_path().parent.parent == home / "kernels"
