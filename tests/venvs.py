"""A throwaway venv that sees the running environment's packages, for tests that install
this package's wheel (installing torch, transformers and datasets there would download
gigabytes)."""

from __future__ import annotations

import importlib.util
import os
import site
import subprocess
import sys
from pathlib import Path

PTH_NAME = "_easy_context_test_environment.pth"


def environment_sites() -> list[str]:
    """The folders this interpreter imports installed packages from: its site-packages (a
    venv's own, plus the base Python's when the venv was made with --system-site-packages;
    a conda env's; a system Python's) and the user site."""
    sites = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        sites.append(site.getusersitepackages())
    return [s for s in sites if os.path.isdir(s)]


def venv_seeing_this_environment(venv: Path) -> Path:
    """Make a venv at ``venv`` whose interpreter imports its own packages first, then this
    environment's; return its python.

    ``--system-site-packages`` would not do: made from inside a venv, it exposes the *base*
    Python's packages, not the running venv's (where torch is). A ``.pth`` file in the new
    venv's site-packages adds this environment's site folders with ``site.addsitedir``:
    after the venv's own site-packages (so a wheel installed there wins over an editable
    install of the same package here), with their own ``.pth`` files run as this
    environment runs them. pip comes from this environment when it has one, else from the
    standard library's bundled wheel (ensurepip: no download)."""
    has_pip = importlib.util.find_spec("pip") is not None
    cmd = [sys.executable, "-m", "venv", str(venv)] + (["--without-pip"] if has_pip else [])
    subprocess.run(cmd, check=True, timeout=300)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    Path(purelib, PTH_NAME).write_text(
        "".join(f"import site; site.addsitedir({s!r})\n" for s in environment_sites()))
    return python
