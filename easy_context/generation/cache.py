"""This rank's share of the KV cache, and the attention calls that fill and read it.

The prefill runs the model on this rank's shard of the prompt with the sequence-parallel
method; each attention layer's keys and values for that shard (after RoPE) stay here, in
the layout the method used: 1/N of the cache on each of N ranks. At each decode step every
rank runs the new token (the same token everywhere) and attends to its own keys
(decode_attention.py); the new token's key and value are kept by one rank, the ranks taking
turns, so no rank's cache grows faster than another's.

The cache is handed to the model as the ``sharded_kv_cache`` keyword argument, which
transformers passes through the layers to the attention function
(integrations/hf.py calls :meth:`ShardedKVCache.attend`); the model itself runs with
``use_cache=False``, so transformers keeps no cache of its own.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..mesh import process_group
from ..parallel.settings import SequenceParallelSettings
from ..sequence_parallel import sequence_parallel_attention
from .decode_attention import merged_attention, visible_keys
from .recurrent_state import RecurrentStates

Tensor = torch.Tensor


class ShardedKVCache:
    """Keys and values of every layer for this rank's tokens.

    ``positions`` (B, capacity) int64 and ``valid`` (B, capacity) bool describe the slots,
    shared by all layers: a slot is invalid for padding (a prompt shorter than the batch's
    longest, or the tokens that pad the prompt to a length the method can shard). Buffers
    are allocated once, at the first prefill call of each layer, for the shard plus this
    rank's share of the new tokens (``reserve``)."""

    def __init__(self, settings: SequenceParallelSettings, world: int, rank: int,
                 reserve: int):
        self.settings = settings
        self.world, self.rank = world, rank
        self.group = process_group(settings.group) if world > 1 else None
        self.reserve = reserve
        # by (layer index, its call within the forward): an attention module shared by
        # several layers (Zamba2's shared block, layer_idx -1) keeps one cache per call
        self.keys: dict[tuple[int, int], Tensor] = {}  # -> (B, Hkv, capacity, D)
        self.values: dict[tuple[int, int], Tensor] = {}  # -> (B, Hkv, capacity, Dv)
        self._calls: dict[int, int] = {}  # this forward's calls so far, by layer index
        self.positions: Tensor | None = None
        self.valid: Tensor | None = None
        self.length = 0  # slots filled in every layer
        self._query: Tensor | None = None  # (B,) positions of the token being decoded
        self._owner = -1  # group rank that keeps the token being decoded
        # a hybrid model's recurrent layers' states (the same on every rank; the routed
        # kernels of integrations/hf_recurrent.py fill and read them)
        self.recurrent = RecurrentStates(self.group, world)

    @staticmethod
    def share(new_tokens: int, world: int) -> int:
        """Slots a rank needs for ``new_tokens`` handed out in turns."""
        return math.ceil(new_tokens / world)

    # ------------------------------------------------------------------ steps
    def start_prefill(self, positions: Tensor, valid: Tensor,
                      lengths: Tensor | None = None) -> None:
        """This rank's shard: (B, S_local) global positions and validity; ``lengths`` (B,)
        the prompts' lengths (a recurrent layer keeps its state at each prompt's end)."""
        b, s = positions.shape
        self.recurrent.start_prefill(positions, valid, lengths)
        capacity = s + self.reserve
        self.positions = positions.new_zeros(b, capacity)
        self.valid = valid.new_zeros(b, capacity)
        self.positions[:, :s], self.valid[:, :s] = positions, valid
        self.length, self._query = s, None
        self._calls = {}

    def start_decode(self, step: int, query_positions: Tensor, keep: bool = True) -> None:
        """Decode step ``step`` (0, 1, ...) for tokens at ``query_positions`` (B,): rank
        ``step % world`` keeps them (no rank when not ``keep``: a forward whose result is
        not used, run only to stay in step with other groups' parameter all-gathers)."""
        self._owner = step % self.world if keep else -1
        self._query = query_positions
        self._calls = {}
        if self._owner == self.rank:
            if self.length >= self.positions.size(1):
                raise RuntimeError(f"KV cache full at {self.length} slots: more new tokens "
                                   "than the cache was sized for")
            self.positions[:, self.length] = query_positions
            self.valid[:, self.length] = True

    @property
    def decoding(self) -> bool:
        """Whether the model is running a decode step (else the prefill)."""
        return self._query is not None

    def finish_decode(self) -> None:
        if self._owner == self.rank:
            self.length += 1
        self._query = None

    # ------------------------------------------------------------------ the attention call
    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True,
               softmax_scale: float | None = None, sliding_window: int | None = None,
               chunk_size: int | None = None, softcap: float | None = None,
               sinks: Tensor | None = None, image_spans=None) -> Tensor:
        """One layer's attention. q (B, S, Hq, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv):
        the shard at prefill (S = S_local), the new token at decode (S = 1). Returns
        (B, S, Hq, Dv). ``image_spans`` (prefill only; Gemma 3): the prompt's bidirectional
        images, as sequence_parallel_attention takes them."""
        if not causal:
            raise ValueError("generation needs causal attention; this layer is not causal")
        call = self._calls.get(layer, 0)
        self._calls[layer] = call + 1
        layer = (layer, call)
        if self._query is None:
            return self._prefill(layer, q, k, v, softmax_scale, sliding_window, chunk_size,
                                 softcap, sinks, image_spans)
        if image_spans:  # a decode token is text: it sees earlier keys only
            raise ValueError("image spans belong to the prompt's prefill, not to decode steps")
        if q.size(1) != 1:
            raise ValueError(f"decode steps take one token per row, got {q.size(1)}")
        keys, values = self.keys[layer], self.values[layer]
        n = self.length
        if self._owner == self.rank:
            keys[:, :, n] = k[:, 0]  # (B, Hkv, D)
            values[:, :, n] = v[:, 0]
            n += 1
        seen = visible_keys(self.positions[:, :n], self.valid[:, :n], self._query,
                            sliding_window, chunk_size)
        scale = softmax_scale if softmax_scale is not None else q.size(-1) ** -0.5
        return merged_attention(q[:, 0], keys[:, :, :n], values[:, :, :n], seen, scale,
                                self.group, self.world, softcap, sinks)

    def _prefill(self, layer, q, k, v, softmax_scale, sliding_window, chunk_size, softcap,
                 sinks, image_spans=None) -> Tensor:
        b, s, hkv, d = k.shape
        capacity = self.positions.size(1)
        keys = k.new_empty(b, hkv, capacity, d)
        values = v.new_empty(b, hkv, capacity, v.size(-1))
        keys[:, :, :s], values[:, :, :s] = k.transpose(1, 2), v.transpose(1, 2)
        self.keys[layer], self.values[layer] = keys, values
        method = self.settings.method if self.world > 1 else "local"
        return sequence_parallel_attention(
            q, k, v, method, group=self.settings.group if self.world > 1 else None,
            causal=True, softmax_scale=softmax_scale, ring_degree=self.settings.ring_degree,
            sliding_window=sliding_window, chunk_size=chunk_size, softcap=softcap,
            sinks=sinks, image_spans=image_spans)

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> int:
        """Bytes this rank holds for the cache (keys, values, positions, validity, and a
        hybrid model's recurrent and convolution states)."""
        tensors = [*self.keys.values(), *self.values.values(), self.positions, self.valid]
        return (sum(t.numel() * t.element_size() for t in tensors if t is not None)
                + self.recurrent.nbytes())


def group_rank(settings: SequenceParallelSettings, world: int) -> int:
    return dist.get_rank(process_group(settings.group)) if world > 1 else 0
