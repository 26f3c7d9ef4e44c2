"""Where localrun and layerplan keep what they fetch, build and measure: `$LOCALRUN_HOME`
(unset or empty: ~/.cache/localrun). Resolved here only; localrun imports it from here."""
from __future__ import annotations

import os
from pathlib import Path


def localrun_home() -> Path:
    """The cache root, absolute: models/, kernels/, kv-cache/, profiles/, layerplan/ live under it."""
    return Path(os.environ.get("LOCALRUN_HOME") or Path.home() / ".cache" / "localrun").expanduser().resolve()
