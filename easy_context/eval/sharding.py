"""One prompt or window, sharded like training, and its statistics summed over the ranks.

Both evals score a single (1, L) sequence per forward pass: every rank of the group calls
:func:`shard_prompt` with the same ids and targets, runs the model on its shard, and sums its
per-token statistics with :meth:`EvalShard.sum`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..mesh import group_size, process_group
from ..parallel import get_method
from ..sequence_parallel import pad_for_sequence_parallel, shard_batch

Tensor = torch.Tensor


@dataclass
class EvalShard:
    input_ids: Tensor  # (1, S_local) on the device
    position_ids: Tensor  # (1, S_local), global positions
    target_ids: Tensor  # (1, S_local), -100 where nothing is scored
    group: object
    world: int

    def sum(self, stats: Tensor) -> Tensor:
        """``stats`` summed over the ranks (in place; ``op`` MAX for ids via :meth:`max`)."""
        if self.world > 1:
            dist.all_reduce(stats, group=process_group(self.group))
        return stats

    def max(self, values: Tensor) -> Tensor:
        if self.world > 1:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=process_group(self.group))
        return values


def shard_prompt(ids: Tensor, targets: Tensor, method: str, pad_id: int, group=None,
                 device: torch.device | str = "cpu", ring_degree: int | None = None) -> EvalShard:
    """This rank's shard of one (1, L) sequence and its targets, right-padded to a length the
    method can shard (pads are never scored). One process, or the local method: the whole
    sequence."""
    m = get_method(method)
    world = 1 if m.layout == "whole" else group_size(group)
    rank = dist.get_rank(process_group(group)) if world > 1 else 0
    ids, targets, positions = pad_for_sequence_parallel(ids, targets, m.name, world, pad_id,
                                                        ring_degree=ring_degree)
    positions = torch.arange(ids.size(1)).unsqueeze(0) if positions is None else positions
    local = shard_batch({"input_ids": ids, "position_ids": positions, "target_ids": targets},
                        m.name, rank, world, ring_degree)
    return EvalShard(**{k: t.to(device) for k, t in local.items()}, group=group, world=world)
