"""Checks that an output path can be written, made before a run spends time on its results."""

from __future__ import annotations

from pathlib import Path


def check_output_path(flag: str, path: str | Path, folder: bool) -> None:
    """Raise if ``path`` (a folder when ``folder``, else a file) cannot be created because it,
    or the nearest of its parents that exists, is the wrong kind of thing."""
    p = Path(path).expanduser()
    if p.exists():
        if folder and not p.is_dir():
            raise NotADirectoryError(f"{flag} {path} is a file; give a folder")
        if not folder and p.is_dir():
            raise IsADirectoryError(f"{flag} {path} is a folder; give a file name")
        return
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise NotADirectoryError(f"{flag} {path}: {parent} is a file, not a folder")
            return


def model_name(path: str) -> str:
    """A short label for a model path: its folder name."""
    return Path(path.rstrip("/")).name or path
