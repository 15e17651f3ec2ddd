"""Page-locked host buffers of exactly the bytes asked, for activations offloaded to host
memory.

``torch.empty(..., pin_memory=True)`` and ``save_on_cpu(pin_memory=True)`` go through torch's
caching host allocator, which rounds every block up to a power of two and keeps freed blocks
cached: a layer input of 2^30 + 1 bytes holds 2^31, so offloaded checkpoints can hold up to
twice what the planner counts. A ``PinnedPool`` allocates plain host tensors of the exact
size and registers them with CUDA (``cudaHostRegister``: page-locked, so copies to and from
the device are asynchronous DMA), and hands the same buffers out again step after step (the
shapes repeat), so it holds one step's offloaded tensors, exactly. On a CPU there is nothing
to register: the pool hands out plain tensors, with the same accounting.
"""

from __future__ import annotations

import logging

import torch

Tensor = torch.Tensor
log = logging.getLogger(__name__)


def caching_allocator_bytes(nbytes: int) -> int:
    """What torch's caching host allocator holds for a pinned block of ``nbytes``: the next
    power of two (its rounding rule)."""
    return 1 << max(0, int(nbytes) - 1).bit_length() if nbytes > 0 else 0


class PinnedPool:
    """Exact-size page-locked host buffers, reused by (shape, dtype)."""

    def __init__(self, pin: bool):
        self.pin = pin  # False on a CPU, where page-locking means nothing
        self._free: dict[tuple, list[Tensor]] = {}
        self._registered: list[Tensor] = []
        self.bytes = 0  # host bytes the pool holds (in use or free)

    def take(self, shape, dtype: torch.dtype) -> Tensor:
        """A host buffer of ``shape`` and ``dtype`` (contents undefined)."""
        key = (tuple(shape), dtype)
        free = self._free.get(key)
        if free:
            return free.pop()
        buf = torch.empty(key[0], dtype=dtype)
        self.bytes += buf.numel() * buf.element_size()
        if self.pin and buf.numel():
            err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(),
                                                       buf.numel() * buf.element_size(), 0)
            if int(getattr(err, "value", err)) != 0:
                raise RuntimeError(f"cudaHostRegister of {buf.numel() * buf.element_size()} "
                                   f"bytes failed ({err}): too little host memory to lock; "
                                   "lower --host-memory or offload less")
            self._registered.append(buf)
        return buf

    def give(self, buf: Tensor) -> None:
        """Hand ``buf`` back for reuse. The caller makes sure no copy still reads or writes it
        (copies in and out of one pool run on one stream, in order)."""
        self._free.setdefault((tuple(buf.shape), buf.dtype), []).append(buf)

    def close(self) -> None:
        """Unregister every buffer (before the memory goes back to the host's allocator)."""
        for buf in self._registered:
            torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
        self._registered, self._free, self.bytes = [], {}, 0

    def __del__(self):
        try:
            if self._registered:
                self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already
            pass
