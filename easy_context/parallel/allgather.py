"""All-gather context parallelism (Llama 3 style) over the zigzag layout.

Rank r holds query/key/value chunks r and 2N-1-r of 2N (chunk length c). Instead of passing
K/V around a ring, every rank all-gathers K and V once, puts them back in sequence order
(layouts.unshard) and attends its two query chunks to the keys they may see. With GQA the
K/V are a fraction of the queries, so one all-gather moves little, and nothing has to be
overlapped step by step as in a ring.

Causal: global query chunk j sees keys [0, (j+1)c): a full (non-causal) block against keys
[0, jc) and a causal diagonal block against [jc, (j+1)c), merged with merge_into. The CPU
kernel's causal mask is top-left aligned, so causal is only ever used on the square diagonal.
The zigzag layout gives every rank chunks j and 2N-1-j, i.e. the same 2N+1 chunk-pairs of
work. Non-causal: every query sees all keys, one block.

Packed documents: the document ids are gathered once per call (one integer per token) and
each block runs as one kernel call per document it holds (blocks.py); no mask.

Sliding windows, chunks, image spans: a rank's queries read only some of the other ranks'
rows; where that is less than the whole shards (:func:`gather_halo`), only those rows travel,
point-to-point, and backward returns their float32 dK/dV to their owners instead of a
reduce-scatter (halo.py).

Backward re-gathers K/V (saving the gathered copies would keep O(S) per layer alive), calls
the kernel's backward per block with the final out and lse, accumulates dK/dV for the whole
sequence in float32, cuts them back into zigzag shards (layouts.shard) and reduce-scatters
them: each owner receives the sum of every rank's contribution to its chunks.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .. import layouts
from ..attention.documents import (Geometry, ShardDocuments, group_key, once_per_ids,
                                   schedule_causal)
from ..attention.variants import Variant, with_softcap
from ..attention.contract import default_scale
from ..attention.selection import select_kernel
from ..mesh import process_group
from .blocks import (backward_block, block_calls, forward_block, group_buffer_choice,
                     plain_documents)
from .comm import all_gather_into, gather_shards, reduce_scatter_into
from .halo import Halo, exchange_kv, halo_plan, rank_geometry, return_partials
from .function import GroupAlgorithm, check_inputs, run_attention
from .method import AttentionDims, Method
from .zigzag import check_two_chunks

Tensor = torch.Tensor


def _pack(k: Tensor, v: Tensor) -> Tensor:
    """K and V as one tensor to gather: stacked (2, B, s, Hkv, D), or, when their head dims
    differ (multi-head latent attention), side by side in the last dim (1, B, s, Hkv, Dk+Dv),
    so that no padding travels."""
    if k.size(-1) == v.size(-1):
        return torch.stack([k, v])
    return torch.cat([k, v], dim=-1).unsqueeze(0)


def _unpack(kv: Tensor, dk: int) -> tuple[Tensor, Tensor]:
    if kv.size(0) == 2:
        return kv[0], kv[1]
    return kv[0][..., :dk], kv[0][..., dk:]


def _gather_kv(k: Tensor, v: Tensor, group, world: int) -> Tensor:
    """Every rank's K and V in sequence order, from one all-gather, packed as :func:`_pack`."""
    local = _pack(k, v)
    if world == 1:
        return local
    # gloo wants the output as the inputs concatenated along dim 0: (N*P, B, s, Hkv, D)
    gathered = local.new_empty(world * local.size(0), *local.shape[1:])
    all_gather_into(gathered, local, group=group)
    gathered = gathered.unflatten(0, (world, local.size(0)))
    # rank order along the sequence dim, then zigzag -> sequence order
    return layouts.unshard(gathered.movedim(0, 2).flatten(2, 3), "zigzag", world, dim=2)


def _blocks(rank: int, world: int, c: int, causal: bool):
    """(query rows, key rows of the full sequence, causal) for this rank's kernel calls."""
    if not causal:
        return [(slice(None), slice(None), False)]
    blocks = []
    for local, j in ((0, rank), (1, 2 * world - 1 - rank)):
        rows = slice(local * c, (local + 1) * c)
        if j > 0:
            blocks.append((rows, slice(0, j * c), False))
        blocks.append((rows, slice(j * c, (j + 1) * c), True))
    return blocks


def gather_documents(doc: Tensor | None, group, world: int, geometry: Geometry | None = None,
                     local_len: int | None = None) -> ShardDocuments | None:
    """Runs of two shards: 0 = this rank's queries, 1 = the whole sequence in order (and,
    with a sliding window or chunks, where each sits)."""
    if doc is None:
        return None if geometry is None else plain_documents((local_len, world * local_len),
                                                             geometry)

    def build():
        # the ids are gathered once, whatever rank's plan is asked (halo.py asks every rank's)
        gathered = once_per_ids(doc, ("gathered ids", group_key(group), world),
                                lambda: gather_shards(doc, group))  # (N, B, s)
        whole = layouts.unshard(gathered.movedim(0, 1).flatten(1, 2), "zigzag", world, dim=1)
        mine = gathered[rank_of(geometry, world)] if geometry is not None else doc
        return ShardDocuments.from_ids([mine, whole], geometry)

    return once_per_ids(doc, ("gathered", group_key(group), world, geometry), build)


def rank_of(geometry: Geometry, world: int) -> int:
    """The rank whose queries ``geometry`` plans (shard 0's first chunk is chunk r)."""
    return geometry.segments[0][0][2] // geometry.segments[0][0][1]


def gather_halo(doc: Tensor | None, group, world: int, local_len: int, causal: bool,
                geometry: Geometry | None) -> Halo | None:
    """The rows of other ranks' K/V this call reads (halo.py), or None where the all-gather
    moves no more (no geometry, or a window that reads nearly everything)."""
    if geometry is None or world == 1:
        return None
    if doc is None:
        halo = plain_halo(world, local_len, causal, geometry)
    else:
        def build():
            return halo_plan(world, local_len, lambda r: list(_block_calls(
                r, world, local_len, causal, gather_documents(
                    doc, group, world, rank_geometry(geometry, r, world, local_len),
                    local_len))))

        halo = once_per_ids(doc, ("halo", group_key(group), world, geometry, causal), build)
    return halo if halo.useful() else None


@functools.lru_cache(maxsize=64)
def plain_halo(world: int, local_len: int, causal: bool, geometry: Geometry) -> Halo:
    """The halo of sequences without documents (every layer of one kind asks the same)."""
    return halo_plan(world, local_len, lambda r: list(_block_calls(
        r, world, local_len, causal, plain_documents(
            (local_len, world * local_len), rank_geometry(geometry, r, world, local_len)))))


def _block_calls(rank, world, s, causal, docs):
    """Per block: (query rows, key rows of the full sequence, its kernel calls), skipping
    blocks no query can see."""
    for rows, keys, blk_causal in _blocks(rank, world, s // 2, causal):
        calls = block_calls(docs, 0, rows, 1, keys, blk_causal)
        if calls:
            yield rows, keys, calls


def _kv_all(k: Tensor, v: Tensor, group, rank: int, world: int, halo: Halo | None) -> Tensor:
    """The whole sequence's K/V packed (:func:`_pack`), sequence order: gathered, or with a
    halo only the rows this rank's calls read (halo.py)."""
    if halo is None:
        return _gather_kv(k, v, group, world)
    return exchange_kv(_pack(k, v), halo, rank, group)


def allgather_forward(q, k, v, group, causal, scale, kernel, docs=None, halo=None):
    """(out in q's dtype, lse (B, H, S) float32) for this rank's queries."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    k_all, v_all = _unpack(_kv_all(k, v, group, rank, world, halo), k.size(-1))
    return gathered_forward(q, k_all, v_all, rank, world, causal, scale, kernel, docs)


def gathered_forward(q, k_all, v_all, rank, world, causal, scale, kernel, docs=None):
    """This rank's zigzag queries against the whole sequence's K/V (sequence order)."""
    b, s, h, d = q.shape
    out = torch.zeros(b, s, h, v_all.size(-1), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    for rows, keys, calls in _block_calls(rank, world, s, causal, docs):
        forward_block(kernel, calls, q[:, rows], k_all[:, keys], v_all[:, keys], scale,
                      out[:, rows], lse[:, :, rows])
    return out.to(q.dtype), lse


def gathered_backward(dout, q, k_all, v_all, out, lse, rank, world, causal, scale, kernel,
                      docs, dk_all: Tensor, dv_all: Tensor) -> Tensor:
    """dq of this rank's queries (float32); adds their dK/dV to ``dk_all``, ``dv_all``
    (float32, the whole sequence)."""
    dq_acc = torch.zeros_like(q, dtype=torch.float32)
    repeated = docs is not None and docs.repeated
    for rows, keys, calls in _block_calls(rank, world, q.size(1), causal, docs):
        dq_b, dk_b, dv_b = backward_block(
            kernel, calls, dout[:, rows], q[:, rows], k_all[:, keys], v_all[:, keys],
            out[:, rows], lse[:, :, rows], scale, sum_float32=repeated)
        dq_acc[:, rows] += dq_b
        dk_all[:, keys] += dk_b
        dv_all[:, keys] += dv_b
    return dq_acc


def allgather_backward(dout, q, k, v, out, lse, group, causal, scale, kernel, docs, *, grads,
                       halo=None):
    """Fills ``grads`` = (dq, dk, dv) (views, the inputs' dtype) for this rank's shards."""
    dq, dk, dv = grads
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    kv = _kv_all(k, v, group, rank, world, halo)
    k_all, v_all = _unpack(kv, k.size(-1))
    dkv = torch.zeros_like(kv, dtype=torch.float32)  # this rank's share, whole sequence
    dk_all, dv_all = _unpack(dkv, k.size(-1))
    dq_acc = gathered_backward(dout, q, k_all, v_all, out, lse, rank, world, causal, scale,
                               kernel, docs, dk_all, dv_all)
    del kv, k_all, v_all
    if halo is not None:  # the partials of the rows read go back to their owners
        dkv = return_partials(dkv, halo, rank, group)
    elif world > 1:
        # send[r] = rank r's zigzag shard of our share; the sum over ranks lands at r.
        send = torch.stack([layouts.shard(dkv, "zigzag", r, world, dim=2) for r in range(world)])
        dkv = torch.empty_like(send[0])
        reduce_scatter_into(dkv, send.flatten(0, 1), group=group)
    dq.copy_(dq_acc)
    dk_own, dv_own = _unpack(dkv, k.size(-1))
    dk.copy_(dk_own)
    dv.copy_(dv_own)


def allgather_attn(q: Tensor, k: Tensor, v: Tensor, group=None, causal: bool = True,
                   softmax_scale: float | None = None, document_ids: Tensor | None = None,
                   ring_degree: int | None = None, variant: Variant | None = None,
                   sinks: Tensor | None = None) -> Tensor:
    """All-gather attention over zigzag shards. q: (B, S/N, Hq, D), k, v: (B, S/N, Hkv, D).

    ``document_ids`` (B, S/N), optional: packed documents; no token attends across them.
    """
    check_inputs(q, k, v, document_ids, sinks)
    check_two_chunks(q)
    scale = default_scale(q.size(-1)) if softmax_scale is None else softmax_scale
    pg = process_group(group)
    world = dist.get_world_size(pg)
    s = q.size(1)
    dims = AttentionDims(q.size(2), k.size(2), q.size(3))
    kernel = with_softcap(select_kernel(q), variant and variant.softcap)
    per_group = group_buffer_choice(
        lambda g: allgather_buffers(dims, s, q.element_size(), world, None, g), q, k,
        kernel, (s, world * k.size(1)))
    rank = dist.get_rank(pg)
    geometry = None if variant is None else variant.geometry(
        (layouts.segments("zigzag", rank, world, s), ((0, world * s, 0),)), causal, world * s)
    # image spans: every block is asked, and the plan keeps the ones a span crosses
    causal = schedule_causal(bool(causal), geometry)
    halo = gather_halo(document_ids, pg, world, s, causal, geometry)
    algo = GroupAlgorithm(allgather_forward, allgather_backward, pg, causal, scale,
                          kernel, gather_documents(document_ids, pg, world, geometry, s),
                          per_group, (("halo", halo),))
    return run_attention(algo, q, k, v, sinks)


# --------------------------------------------------------------------------- planner costs
def allgather_buffers(dims: AttentionDims, s: int, a: int, world: int,
                      ring_degree: int | None, kv_heads: int = 1) -> int:
    """Per KV head of a group: its query heads' float32 dq (g D x 4 per token), the whole
    sequence's K/V gathered (and reordered: 2 copies), their float32 dK/dV and the
    reduce-scatter send buffer: N s x 2D x (2a + 8)."""
    hq, hkv, hd = dims
    return kv_heads * (s * (hq // hkv) * hd * 4 + world * s * 2 * hd * (2 * a + 8))


def allgather_comm(dims: AttentionDims, s: int, a: int, world: int,
                   ring_degree: int | None) -> int:
    """K/V gathered in forward and again in backward (each rank's shard goes to N-1 others),
    and the float32 dK/dV reduce-scattered."""
    hq, hkv, hd = dims
    kv = s * 2 * hkv * hd
    return (world - 1) * kv * (2 * a + 4)


def allgather_latent_comm(latent: int, s: int, a: int, world: int) -> int:
    """Multi-head latent attention (parallel/latent.py): each token's ``latent`` values
    (kv_lora_rank + qk_rope_head_dim) gathered once in forward (the whole sequence's latent
    stays saved for the up-projection's backward, so backward gathers nothing), and their
    float32 gradient reduce-scattered."""
    return (world - 1) * s * latent * (a + 4)


def allgather_unsuitable(heads: int, kv_heads: int, world: int) -> str | None:
    if heads < GQA_RATIO * kv_heads:
        return (f"K/V are {kv_heads}/{heads} of the heads (no strong GQA): gathering them "
                "costs more than a ring")
    return None


GQA_RATIO = 4  # heads / kv_heads from which all-gathering K/V is cheaper than a ring

METHOD = Method(
    name="allgather_attn", attention=allgather_attn, layout="zigzag", short="AG", speed_rank=3,
    summary="K/V gathered once per layer (Llama-3 style), zigzag query shards; multi-head "
            "latent attention layers gather their latent instead (integrations/hf_latent.py)",
    use_when="few KV heads (GQA), or multi-head latent attention (its latent travels): one "
             "gather moves little", aliases=("allgather",),
    unsuitable=allgather_unsuitable, group_buffers=allgather_buffers,
    kernel_call=lambda dims, s, world, rd: (s, s * world, dims),
    comm_bytes=allgather_comm, latent_comm_bytes=allgather_latent_comm)
