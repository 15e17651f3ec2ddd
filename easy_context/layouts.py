"""How one sequence is cut into per-rank shards, and put back together.

Pure tensor code: no process groups, no communication. Every sequence-parallel
method names one of these layouts, and the tests build their references by
sharding full tensors with exactly this code.

- ``whole``: no split: every rank holds the whole sequence (data parallelism, one process).
- ``contiguous``: rank r holds tokens [r*L/N, (r+1)*L/N).
- ``zigzag``: the sequence is cut into 2N chunks; rank r holds chunks r and
  2N-1-r. Under a causal mask every rank then has the same amount of work.
- ``usp``: zigzag across the ``ring_degree`` ring ranks, then contiguous across
  the ``ulysses_degree = N // ring_degree`` ranks inside each ring rank's shard.
  Global rank r is ring rank ``r // ulysses_degree`` and Ulysses rank
  ``r % ulysses_degree``, so each Ulysses group is a run of neighbouring ranks
  (on one node, where all-to-all is cheap).
"""

from __future__ import annotations

import math

import torch

LAYOUTS = ("whole", "contiguous", "zigzag", "usp")


def _check_degrees(layout: str, world_size: int, ring_degree: int | None) -> int:
    """Validate the layout and world size; return the ring degree (usp) or 0."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if layout != "usp" or world_size == 1:
        return 0
    if ring_degree is None:
        raise ValueError("the usp layout needs ring_degree (the number of ring ranks)")
    if ring_degree < 1 or world_size % ring_degree != 0:
        raise ValueError(
            f"ring_degree={ring_degree} does not divide world_size={world_size}; "
            f"pick a ring_degree among {[d for d in range(1, world_size + 1) if world_size % d == 0]}"
        )
    return ring_degree


def required_multiple(layout: str, world_size: int, ring_degree: int | None = None) -> int:
    """The number the sequence length must be a multiple of for this layout."""
    ring = _check_degrees(layout, world_size, ring_degree)
    if layout == "whole" or world_size == 1:  # one rank holds the whole sequence
        return 1
    if layout == "contiguous":
        return world_size
    if layout == "zigzag":
        return 2 * world_size
    # usp: 2*ring chunks, and each ring rank's 2 chunks split evenly over the Ulysses ranks.
    return math.lcm(2 * ring, world_size)


def check_length(length: int, layout: str, world_size: int, ring_degree: int | None = None) -> None:
    """Raise a ValueError that says what to change when ``length`` cannot be sharded."""
    multiple = required_multiple(layout, world_size, ring_degree)
    if length % multiple != 0:
        up = -(-length // multiple) * multiple
        raise ValueError(
            f"sequence length {length} is not divisible by {multiple} "
            f"(the {layout} layout over {world_size} ranks"
            + (f", ring_degree={ring_degree}" if layout == "usp" else "")
            + f"); pad it to {up} (easy_context.pad_for_sequence_parallel does this) "
            f"or pick a seq length that is a multiple of {multiple}"
        )


def _zigzag_chunks(x: torch.Tensor, world_size: int, dim: int) -> tuple[torch.Tensor, ...]:
    return x.chunk(2 * world_size, dim=dim)


def shard(x: torch.Tensor, layout: str, rank: int, world_size: int, dim: int = 1,
          ring_degree: int | None = None) -> torch.Tensor:
    """Return rank ``rank``'s shard of ``x`` along ``dim`` (a new contiguous tensor)."""
    check_length(x.size(dim), layout, world_size, ring_degree)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside [0, {world_size})")
    if layout == "whole" or world_size == 1:
        return x
    if layout == "contiguous":
        return x.chunk(world_size, dim=dim)[rank].contiguous()
    if layout == "zigzag":
        chunks = _zigzag_chunks(x, world_size, dim)
        return torch.cat([chunks[rank], chunks[2 * world_size - 1 - rank]], dim=dim)
    uly = world_size // ring_degree
    ring_rank, uly_rank = divmod(rank, uly)
    ring_shard = shard(x, "zigzag", ring_rank, ring_degree, dim)
    return ring_shard.chunk(uly, dim=dim)[uly_rank].contiguous()


def unshard(x_all: torch.Tensor, layout: str, world_size: int, dim: int = 1,
            ring_degree: int | None = None) -> torch.Tensor:
    """Inverse of :func:`shard`: ``x_all`` is every rank's shard concatenated in rank order
    (for ``whole``, one rank's copy: they are all the same)."""
    check_length(x_all.size(dim), layout, world_size, ring_degree)
    if layout in ("whole", "contiguous") or world_size == 1:
        return x_all.contiguous()
    if layout == "zigzag":
        held = _zigzag_chunks(x_all, world_size, dim)  # rank r's two chunks at 2r, 2r+1
        first = [held[2 * r] for r in range(world_size)]
        second = [held[2 * r + 1] for r in reversed(range(world_size))]
        return torch.cat(first + second, dim=dim)
    # usp: each run of `uly` neighbouring shards is one ring rank's zigzag shard.
    return unshard(x_all, "zigzag", ring_degree, dim)


def pad_to_multiple(input_ids: torch.Tensor, target_ids: torch.Tensor | None, multiple: int,
                    pad_id: int, position_ids: torch.Tensor | None = None, dim: int = 1,
                    ignore_index: int = -100):
    """Pad ``input_ids`` (with ``pad_id``), ``target_ids`` (with ``ignore_index``) and
    ``position_ids`` (continuing the count) on the right, to the next multiple of ``multiple``.

    Padding goes at the end, so under a causal mask no real token attends to it, and its
    targets are ignored by the loss: the result's loss equals the unpadded one.
    Returns ``(input_ids, target_ids, position_ids)``; absent inputs stay None.
    """
    if multiple < 1:
        raise ValueError(f"multiple must be >= 1, got {multiple}")
    length = input_ids.size(dim)
    extra = (-length) % multiple

    def _pad(t, value):
        if t is None or extra == 0:
            return t
        shape = list(t.shape)
        shape[dim] = extra
        return torch.cat([t, t.new_full(shape, value)], dim=dim)

    if position_ids is not None and extra:
        last = position_ids.narrow(dim, length - 1, 1)
        steps = torch.arange(1, extra + 1, device=position_ids.device, dtype=position_ids.dtype)
        view = [1] * position_ids.dim()
        view[dim] = extra
        position_ids = torch.cat([position_ids, last + steps.view(view)], dim=dim)
    return _pad(input_ids, pad_id), _pad(target_ids, ignore_index), position_ids


def segments(layout: str, rank: int, world_size: int, length: int,
             ring_degree: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """Where rank ``rank``'s shard of ``length`` rows sits in the sequence: stretches of
    consecutive positions as (first row, one past the last row, position of the first row).
    What sliding windows and chunks are planned from (attention/documents.py)."""
    _check_degrees(layout, world_size, ring_degree)
    if layout == "whole" or world_size == 1:
        return ((0, length, 0),)
    if layout == "contiguous":
        return ((0, length, rank * length),)
    if layout == "zigzag":
        c = length // 2
        return ((0, c, rank * c), (c, length, (2 * world_size - 1 - rank) * c))
    raise ValueError("usp shards are planned as the Ulysses-gathered zigzag shards of the ring "
                     "(parallel/usp.py); ask for the zigzag segments of the ring rank")
