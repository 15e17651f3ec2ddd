"""Communication for the sequence-parallel methods: batched point-to-point transfers, and
the collectives under the names this torch version gives them.

Every function takes the process group explicitly; ``None`` means the world group. Peers are
given as ranks *within* the group and translated to global ranks here, because
torch.distributed's P2P ops address global ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor
# torch 2.13 renamed the *_tensor collectives (the old names warn); older torch has only those.
all_gather_into = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_into = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _global(group: dist.ProcessGroup | None, group_rank: int) -> int:
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


class Exchange:
    """A batch of sends and receives posted together, waited on later.

    Posting the next block's transfer before computing on the current block is how the ring
    methods hide communication behind compute.
    """

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        self._ops: list[dist.P2POp] = []
        self._reqs: list = []

    def send(self, tensor: Tensor, to: int) -> None:
        self._ops.append(dist.P2POp(dist.isend, tensor.contiguous(), _global(self.group, to), self.group))

    def recv(self, like: Tensor, frm: int) -> Tensor:
        return self.recv_into(torch.empty_like(like, memory_format=torch.contiguous_format), frm)

    def recv_into(self, buf: Tensor, frm: int) -> Tensor:
        """Receive into ``buf`` (contiguous: a view of a larger tensor saves the copy out)."""
        if not buf.is_contiguous():
            raise ValueError("a receive buffer must be contiguous")
        self._ops.append(dist.P2POp(dist.irecv, buf, _global(self.group, frm), self.group))
        return buf

    def start(self) -> "Exchange":
        if self._ops:
            self._reqs = dist.batch_isend_irecv(self._ops)
        self._ops = []
        return self

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []


def ring_pass(tensors: list[Tensor], group: dist.ProcessGroup | None) -> tuple[Exchange, list[Tensor]]:
    """Start sending ``tensors`` to the next rank and receiving the previous rank's.

    Returns the started exchange and the receive buffers (valid after ``exchange.wait()``).
    """
    rank, world = group_rank_size(group)
    ex = Exchange(group)
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    bufs = []
    for t in tensors:
        ex.send(t, nxt)
        bufs.append(ex.recv(t, prv))
    return ex.start(), bufs


def gather_shards(t: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """(N, *t.shape): every rank's ``t`` stacked in group-rank order (one all-gather)."""
    world = dist.get_world_size(group)
    if world == 1:
        return t.unsqueeze(0)
    # gloo wants the output as the inputs concatenated along dim 0
    out = t.new_empty(world * t.size(0), *t.shape[1:])
    all_gather_into(out, t.contiguous(), group=group)
    return out.unflatten(0, (world, t.size(0)))
