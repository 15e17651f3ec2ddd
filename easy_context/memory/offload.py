"""Where a fused layer (easy_context.memory.fused_layer) keeps its input between forward and
backward: on the device, or in host memory with the next one copied back ahead of time.

``LayerStorage`` copies each layer's kept tensors to host memory in forward (pinned, on a side
CUDA stream, so the copy overlaps the next layer's compute) and, in backward, when layer l's
tensors are taken back, starts copying layer l-1's to the device on that stream: by the time
layer l's backward (seconds at long contexts) is done, l-1's input is there. At most two
layers' tensors are on the device at once (the one in use and the one arriving: a double
buffer), against all of them with ``DeviceStorage``. When offloading, the last layer's
tensors are needed first, right after the loss, so they stay on the device.

On a CPU the same code runs without streams (the "host" copy is a plain copy in the same
memory, which saves nothing there; the planner never picks it on a CPU). Host buffers come
from a ``PinnedPool`` (pinned.py): exact sizes, page-locked on CUDA, reused every step, so
host memory holds what the planner counts (the caching host allocator would round each up to
a power of two). ``HostCheckpoints`` is the same storage for ``--checkpointing offload``'s
per-tensor saved inputs.

A layer input that is cheaper to compute than to keep (the first layer's: the embedding of the
token ids) is kept as a recipe, a function that computes it again when backward needs it.

Two-level (nested) recompute, for when host memory is the limit: with ``keep_every = k``
only every k-th layer's input is copied out; the others are regenerated in backward by
running the layers from the last kept input forward again (without autograd), once per
group of k layers, so host memory holds L/k + k layer inputs instead of L, for one more
forward of each layer (easy_context.memory.maxlen wires the layers' forwards in). Without
offload, the last layer a group regenerates, the next to run backward, keeps the attention
results of its regeneration on the device for that backward, so with k = 2 the nested
recompute runs no attention again (one layer's attention output more on the device while
the group's last layer runs backward); with offload the device memory goes first.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch

from .pinned import PinnedPool

Tensor = torch.Tensor


class DeviceStorage:
    """Keep the tensors where they are (plain checkpointing), or only the ``recipe`` that
    computes the one tensor again (the first layer's input: an embedding lookup)."""

    def pack(self, tensors: list[Tensor], index: int | None = None, forward=None,
             recipe: Callable[[], Tensor] | None = None):
        return recipe if recipe is not None else tensors

    def unpack(self, handle) -> list[Tensor]:
        return [handle()] if callable(handle) else list(handle)


class _Entry:
    """One layer's kept tensors: on the host, possibly on their way back to the device."""

    def __init__(self, host: list[Tensor], device: torch.device, ready=None):
        self.host, self.device = host, device
        self.ready = ready  # CUDA event: the host copy is complete
        self.arriving: list[Tensor] | None = None  # prefetched device copies
        self.arrived = None  # CUDA event: the prefetch is complete


class _Pass:
    """One forward's kept layer tensors (an entry per layer index: an _Entry on the host, a
    list on the device, a recipe, or None for a layer the nested recompute regenerates) and
    its layers' forwards (for that recompute). Each layer's handle holds its pass, so a
    second forward before the backward (gradient accumulation as (model(a) + model(b))
    .backward()) keeps its own; a pass whose graph is dropped without a backward goes with it."""

    __slots__ = ("entries", "forwards", "__weakref__")

    def __init__(self):
        self.entries: dict[int, object] = {}
        self.forwards: dict[int, Callable | None] = {}


class LayerStorage:
    """Layer inputs in host memory, the previous layer's prefetched while one runs backward.

    ``layers``: how many layers pack per forward (with offload, the last one stays on the
    device);
    ``offload``: False keeps the tensors on the device (for the nested recompute alone);
    ``keep_every``: keep every k-th layer's input only (nested recompute, k > 1).

    Every forward (its first layer packs index 0) starts a new pass (_Pass); a layer's handle
    names its pass, so forwards that wait for one backward each find their own tensors.
    """

    def __init__(self, layers: int, offload: bool = True, keep_every: int = 1):
        if keep_every < 1:
            raise ValueError(f"keep_every must be >= 1, got {keep_every}")
        self.layers, self.offload, self.keep_every = layers, offload, keep_every
        self._pass = _Pass()  # the forward packing now (or the last one)
        self._passes: weakref.WeakSet = weakref.WeakSet()  # every pass a graph still holds
        self._stream = None
        self.pool: PinnedPool | None = None

    @property
    def entries(self) -> dict[int, object]:
        """The latest forward's kept entries, by layer index."""
        return self._pass.entries

    @property
    def forwards(self) -> dict[int, Callable | None]:
        return self._pass.forwards

    def pending(self) -> list[_Pass]:
        """The passes that still hold tensors for a backward to come."""
        return [p for p in list(self._passes) if p.entries]

    def _host_buffer(self, t: Tensor) -> Tensor:
        if self.pool is None:
            self.pool = PinnedPool(pin=t.device.type == "cuda")
        return self.pool.take(t.shape, t.dtype)

    def _release(self, entry: "_Entry") -> None:
        """Hand the host buffers of an entry taken back for good (not one the nested
        recompute fetches to regenerate from, which stays) back to the pool once its device
        copy is issued: the next copy into them runs on the same side stream, after this one."""
        if self.pool is not None and self.offload:
            for h in {id(h): h for h in entry.host}.values():
                self.pool.give(h)
        entry.host = []

    # ---------------------------------------------------------------- streams
    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _to_host(self, tensors: list[Tensor]) -> tuple[list[Tensor], object]:
        if not self.offload:
            return list(tensors), None
        dev = tensors[0].device
        stream = self._side_stream(dev)
        if stream is None:
            host = []
            for t in tensors:
                buf = self._host_buffer(t)
                buf.copy_(t.detach())
                host.append(buf)
            return host, None
        stream.wait_stream(torch.cuda.current_stream(dev))  # the tensors are computed
        seen: dict[tuple, Tensor] = {}
        host = []
        with torch.cuda.stream(stream):
            for t in tensors:
                key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
                if key not in seen:  # one copy of tensors that alias (a group's out and its record)
                    seen[key] = self._host_buffer(t)
                    seen[key].copy_(t, non_blocking=True)
                    t.record_stream(stream)  # not reused by the allocator before the copy ends
                host.append(seen[key])
            ready = torch.cuda.Event()
            ready.record(stream)
        return host, ready

    def _to_device(self, entry: _Entry) -> None:
        if not self.offload:
            entry.arriving = list(entry.host)
            return
        stream = self._side_stream(entry.device)
        if stream is None:  # a real copy on a CPU too, so it holds what a GPU would
            entry.arriving = [h.to(entry.device, copy=True) for h in entry.host]
            return
        with torch.cuda.stream(stream):
            stream.wait_event(entry.ready)
            copies: dict[int, Tensor] = {}
            entry.arriving = []
            for h in entry.host:
                if id(h) not in copies:
                    copies[id(h)] = h.to(entry.device, non_blocking=True)
                entry.arriving.append(copies[id(h)])
            entry.arrived = torch.cuda.Event()
            entry.arrived.record(stream)

    def _take(self, entry: _Entry) -> list[Tensor]:
        """The device copy of an entry's tensors, ready on the current stream: the prefetched
        one, else copied now."""
        if entry.arriving is None:
            self._to_device(entry)
        tensors, entry.arriving = entry.arriving, None
        if entry.arrived is not None:
            current = torch.cuda.current_stream(entry.device)
            current.wait_event(entry.arrived)
            for t in tensors:
                t.record_stream(current)
        entry.arrived = None
        return tensors

    # ---------------------------------------------------------------- pack / unpack
    def pack(self, tensors: list[Tensor], index: int,
             forward: Callable[[Tensor, bool], Tensor] | None = None,
             recipe: Callable[[], Tensor] | None = None):
        """Keep layer ``index``'s tensors; ``forward(x, keep) -> layer output`` (no autograd)
        lets the nested recompute regenerate the next layer's input (``keep``: this layer's
        backward comes next, so it may keep what that would recompute); ``recipe() -> tensors[0]``,
        when given, is kept instead of the one tensor. Returns the handle."""
        if index == 0 or index in self._pass.forwards:
            self._pass = _Pass()  # a new forward (the earlier ones stay with their handles)
            self._passes.add(self._pass)
        fwd = self._pass
        fwd.forwards[index] = forward
        if recipe is not None:
            fwd.entries[index] = recipe  # computed again where it is needed, never copied
        elif self.offload and index == self.layers - 1:
            # needed first in backward: stays put rather than going out and straight back.
            # Without offload (the nested recompute alone) it follows keep_every like the
            # others: kept, it would only add one input to the forward and the loss while the
            # backward's peak (the last group's regenerated inputs) stays the same.
            fwd.entries[index] = list(tensors)
        elif index % self.keep_every == 0:
            host, ready = self._to_host(tensors)
            fwd.entries[index] = _Entry(host, tensors[0].device, ready)
        else:  # nested recompute: regenerated from the last kept input in backward
            fwd.entries[index] = None
        return fwd, index

    def unpack(self, handle: tuple[_Pass, int]) -> list[Tensor]:
        fwd, index = handle
        entry = fwd.entries.pop(index)
        if entry is None:
            entry = self._regenerate(fwd, index)
        if isinstance(entry, list):
            tensors = entry
        elif callable(entry):  # a recipe
            tensors = [entry()]
        else:  # prefetched, or (the first one) copied now
            tensors = self._take(entry)
            self._release(entry)  # popped: its host copy is done with
        fwd.forwards.pop(index, None)
        previous = fwd.entries.get(index - 1)
        if isinstance(previous, _Entry) and previous.arriving is None:
            self._to_device(previous)  # overlaps this layer's backward
        return tensors

    def _regenerate(self, fwd: _Pass, index: int) -> list[Tensor]:
        """Run layers first..index-1 of the forward ``fwd`` again from the last kept
        input (layer first's), keep the inputs they produce on the host, return layer
        index's (on the device)."""
        first = index - index % self.keep_every
        kept = fwd.entries[first]
        x = kept() if callable(kept) else self._take(kept)[0]
        for i in range(first, index):
            # the layer whose backward comes next keeps the attention it computes on the way
            # (on the device: offloading is for when the device is the limit, so not then)
            x = fwd.forwards[i](x, i + 1 == index and not self.offload)
            if i + 1 < index:
                host, ready = self._to_host([x])
                fwd.entries[i + 1] = _Entry(host, x.device, ready)
        return [x]


class HostCheckpoints:
    """``--checkpointing offload``'s storage for the tensors each layer's (reentrant)
    checkpoint saves, its inputs: copied to exact-size pinned host buffers on a side stream
    as they are saved (the copy overlaps the next layer's forward; ``save_on_cpu`` copies
    synchronously, one stall a layer), and in backward, when layer l's come back, layer
    l-1's start copying to the device on that stream while l runs backward. The last layer's
    stay on the device (they are needed first). Used through :meth:`hooks`."""

    def __init__(self, layers: int):
        self.layers = layers
        self.copies = LayerStorage(layers)  # the side stream, the pool and the copies
        # the forward saving now: per layer, its saved tensors' entries. Each handle names
        # its forward, so forwards that wait for one backward each find their own.
        self._pass = _Pass()
        self._passes: weakref.WeakSet = weakref.WeakSet([self._pass])
        self._last = -1  # the layer that packed last: a lower one starts a new forward pass

    @property
    def entries(self) -> dict[int, list[_Entry]]:
        """The latest forward's entries, by layer index."""
        return self._pass.entries

    def pending(self) -> list[_Pass]:
        """The forwards that still hold a host copy for a backward to come."""
        return [p for p in list(self._passes)
                if any(e.host for entries in p.entries.values() for e in entries)]

    def hooks(self, index: int) -> torch.autograd.graph.saved_tensors_hooks:
        """Saved-tensor hooks for layer ``index``'s checkpoint call."""
        return torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(index, t), self._unpack)

    def _pack(self, index: int, t: Tensor):
        if index < self._last:
            self._pass = _Pass()  # a new forward (the earlier ones stay with their handles)
            self._passes.add(self._pass)
        self._last = index
        fwd = self._pass
        if index == self.layers - 1 or not t.numel():
            return (fwd, index, t)  # kept where it is
        host, ready = self.copies._to_host([t])
        fwd.entries.setdefault(index, []).append(_Entry(host, t.device, ready))
        return (fwd, index, len(fwd.entries[index]) - 1)

    def _unpack(self, handle) -> Tensor:
        fwd, index, slot = handle
        if isinstance(slot, Tensor):  # kept on the device
            t = slot
        else:
            entry = fwd.entries[index][slot]
            (t,) = self.copies._take(entry)  # prefetched, unless the layer after kept it
            self.copies._release(entry)
        for previous in fwd.entries.get(index - 1, ()):
            if previous.arriving is None and previous.host:
                self.copies._to_device(previous)  # overlaps this layer's backward
        return t
