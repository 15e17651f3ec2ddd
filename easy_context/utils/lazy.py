"""Package attributes imported on first use (PEP 562): ``import easy_context`` and
``import easy_context.data`` stay light, so a command that needs neither torch's nor
transformers' heavy modules does not pay seconds for them."""

from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str]):
    """``__getattr__`` and ``__dir__`` for ``package`` whose public names live in the
    submodules ``exports`` gives (name -> module relative to the package: "needle", or
    "..models" for a sibling of the package)."""
    module = importlib.import_module(package)

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        where = exports[name]
        relative = where if where.startswith(".") else "." + where
        value = getattr(importlib.import_module(relative, package), name)
        setattr(module, name, value)  # found once
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(exports))

    return __getattr__, __dir__
