"""Whole-sequence tensors that max-length mode computes again instead of keeping.

Two of the tensors a decoder layer is given cost next to nothing to compute and a sequence of
activations to keep: the first layer's input, the embedding of the token ids, and the RoPE
cos/sin tables every layer is handed. A forward hook on the module that makes each one
records how it was called; a layer that is handed the very result (the same memory,
unchanged since) keeps a *recipe*, a function that calls the module's own forward again
with the same arguments, and its backward calls it where it needs the tensor. Anything else
(a model that scales its embeddings outside the embedding module, per-layer RoPE tables from
another module) is not recognised and kept as before.

Recomputing is exact: the same deterministic lookup or elementwise formula on the same
inputs, with the same weights (the optimizer steps only after backward).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Callable

import torch
from torch import nn

Tensor = torch.Tensor

# RoPE types whose tables depend on the positions alone (not on the sequence length seen so
# far, as dynamic and longrope scaling do)
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class Recorded:
    """The last call of one module (its arguments, weak references to its output tensors and
    their versions), and recipes for that output."""

    def __init__(self, module: nn.Module,
                 gathered: Callable[[nn.Module], contextlib.AbstractContextManager],
                 stub_first: bool = False):
        self.module, self.gathered = module, gathered
        # the RoPE module reads only its first argument's dtype and device: keep a stand-in,
        # not the hidden states
        self.stub_first = stub_first
        self.call = None  # (args, kwargs, [(weakref, version)] per output tensor)
        self.handle = module.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        outs = output if isinstance(output, tuple) else (output,)
        if (not args or not all(isinstance(t, Tensor) for t in outs)
                or any(t.is_inference() for t in outs)):
            # inference tensors (torch.inference_mode) keep no version counter to check the
            # outputs against; nothing under inference mode is differentiated anyway
            self.call = None
            return
        if self.stub_first:
            x = args[0]
            args = (torch.empty(0, dtype=x.dtype, device=x.device), *args[1:])
        self.call = (args, kwargs, [(weakref.ref(t), t._version) for t in outs])

    def recipe(self, *tensors: Tensor) -> Callable[[], Tensor | tuple] | None:
        """A function that computes ``tensors`` again, if they are the last call's outputs
        as that call made them; else None."""
        if self.call is None:
            return None
        args, kwargs, outs = self.call
        if len(outs) != len(tensors):
            return None
        for t, (ref, version) in zip(tensors, outs):
            out = ref()
            if (out is None or out._version != version or t.data_ptr() != out.data_ptr()
                    or t.shape != out.shape or t.stride() != out.stride()
                    or t.dtype != out.dtype):
                return None
        module, gathered = self.module, self.gathered

        def again():
            # the module's own forward: no hooks (ZeRO-3 would release its weights, FSDP
            # gather them, this class record again), with its weights gathered
            with torch.no_grad(), gathered(module):
                return module.forward(*args, **kwargs)

        return again

    def remove(self) -> None:
        self.handle.remove()


def watch(module: nn.Module | None, gathered, stub_first: bool = False) -> Recorded | None:
    """Record ``module``'s calls (replacing an earlier watcher of the same module)."""
    if not isinstance(module, nn.Module):
        return None
    old = getattr(module, "_ec_recorded", None)
    if old is not None:
        old.remove()
    module._ec_recorded = Recorded(module, gathered, stub_first)
    return module._ec_recorded
