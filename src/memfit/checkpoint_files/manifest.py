"""The manifest of a checkpoint: what it holds, so that a resume can tell a damaged one from a good one.

`manifest.json` lists every other file of the checkpoint with its size and SHA-256, the
memfit and torch versions that wrote it, and the config. It is written last, into the
temporary directory, before the atomic rename; a checkpoint whose files no longer match
it (a copy cut short, a flipped byte on a bad disk) is skipped on resume.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

MANIFEST = "manifest.json"
_CHUNK = 8 * 1024 * 1024


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def memfit_version() -> str:
    try:
        return metadata.version("memfit")
    except metadata.PackageNotFoundError:
        return "unknown"


def write_manifest(directory: Path, config_dict: dict[str, Any]) -> dict[str, Any]:
    """Describe every file under `directory` in `directory/manifest.json`; returns the manifest."""
    manifest = {
        "format": 1,
        "memfit_version": memfit_version(),
        "torch_version": torch.__version__,
        "files": {
            path.relative_to(directory).as_posix(): {"bytes": path.stat().st_size, "sha256": _sha256(path)}
            for path in _files(directory)
        },
        "config": config_dict,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def checkpoint_problem(directory: Path) -> str | None:
    """What is wrong with the checkpoint at `directory`, in a few words; None when its files match its manifest.

    A checkpoint written before manifests existed has none: it is taken as it is (None).
    """
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, expected in files.items():
        file = directory / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected["bytes"]:
            return f"{name} has {size} bytes, the manifest says {expected['bytes']}"
        if _sha256(file) != expected["sha256"]:
            return f"{name} does not match its SHA-256 (a changed byte)"
    extra = {p.relative_to(directory).as_posix() for p in _files(directory)} - set(files)
    if extra:
        return f"{sorted(extra)[0]} is not in the manifest"
    return None
