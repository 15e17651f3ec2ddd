"""When the sequence-parallel methods become transformers attention implementations.

``import easy_context`` must keep two promises: it is light (the CLI's commands that never
touch a model start without the ~6 s that importing transformers' modeling code costs on
a 2-core machine: ``synth-data`` in 0.2 s, ``plan`` and ``plot-ppl`` in 2 s), and once transformers can
build a model, ``attn_implementation="zigzag_ring_attn"`` (or any method's name) works. So
registration (easy_context.integrations.hf) happens as soon as transformers' modeling code
is there: now if it is already imported, else right after ``transformers.modeling_utils``
(where ``AttentionInterface`` lives) finishes importing, whoever imports it. A tokenizer-only
use of transformers (prepare-data) never pays for it.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MODELING = "transformers.modeling_utils"


def _register() -> None:
    importlib.import_module("easy_context.integrations.hf")  # registers on import


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``name`` it returns the spec the other finders give, with
    ``callback`` run after the module's code (once, then it leaves ``sys.meta_path``)."""

    def __init__(self, name: str, callback):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run, callback = spec.loader.exec_module, self.callback

        def exec_module(module):
            run(module)
            callback()

        spec.loader.exec_module = exec_module
        return spec


def install() -> None:
    """Register now, or as soon as transformers' modeling code is imported."""
    if MODELING in sys.modules:
        _register()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(MODELING, _register))
