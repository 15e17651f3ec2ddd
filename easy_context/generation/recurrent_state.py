"""A hybrid model's recurrent and convolution states for generation, in transformers' own cache.

The prefill runs the prompt sequence-parallel (the routed kernels of
integrations/hf_recurrent.py); each recurrent layer's state at the end of every prompt is
what the decode steps start from. transformers keeps those states in a ``Cache`` whose layers
are ``LinearAttentionLayer`` objects (``conv_states`` / ``recurrent_states`` by layer index), and
its layers' decode paths (``causal_conv1d_update``, the single-step gated delta rule or KDA,
Mamba-2's and Mamba-1's ``selective_state_update``) read and update them there: :class:`RecurrentStates` holds one such
cache, the same on every rank (every rank decodes every new token).

- The recurrent state (gated delta rule, KDA, Mamba-2, Mamba-1): the scan's final state, which every rank
  already computes from the all-gathered piece maps (recurrent/scan.py). The prompts' pad
  slots (after each prompt's end, generate.py) are made to leave the state unchanged (no
  decay, no input: the routed kernels' job), so the state after the padded shard is the
  state after each prompt's last token.
- The convolution state: the last K inputs of each prompt (transformers' ``update_conv_state``
  keeps K, zeros before the start), which may lie on several ranks when the shards are shorter
  than K: each rank writes the ones it holds into zeros, then one all-reduce (a sum of one
  value and zeros: exact).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.cache_utils import Cache, LinearAttentionLayer

Tensor = torch.Tensor


class RecurrentStates:
    """Every recurrent layer's states for the rows being generated, by layer index."""

    def __init__(self, group, world: int):
        self.group, self.world = group, world
        self.cache = Cache(layers=[])  # transformers' own container; layers added by index
        self.positions: Tensor | None = None  # (B, S_local) this rank's prompt slots
        self.valid: Tensor | None = None
        self.lengths: Tensor | None = None  # (B,) each prompt's length

    def start_prefill(self, positions: Tensor, valid: Tensor, lengths: Tensor | None) -> None:
        self.positions, self.valid = positions, valid
        self.lengths = None if lengths is None else lengths.to(positions.device)

    def _layer(self, index: int) -> None:
        while len(self.cache.layers) <= index:
            self.cache.layers.append(LinearAttentionLayer())

    # ------------------------------------------------------------------ prefill
    def keep_conv_inputs(self, index: int, state_idx: int, x: Tensor, kernel_size: int) -> None:
        """x (B, C, S_local): a convolution's inputs on this rank's shard; keeps each prompt's
        last ``kernel_size`` inputs (zeros before position 0) as transformers' cache does."""
        if self.lengths is None:
            raise RuntimeError("the prefill was started without the prompts' lengths")
        b, c, _ = x.shape
        k = kernel_size
        slot = self.positions - (self.lengths[:, None] - k)  # (B, S_local): index in the window
        take = self.valid & (slot >= 0) & (slot < k)
        window = x.new_zeros(b, k, c)
        rows, cols = take.nonzero(as_tuple=True)
        window[rows, slot[rows, cols]] = x[rows, :, cols]
        window = window.transpose(1, 2).contiguous()  # (B, C, K)
        if self.world > 1:
            dist.all_reduce(window, group=self.group)
        self._layer(index)
        self.cache.update_conv_state(window, index, state_idx=state_idx, conv_kernel_size=k)

    def keep_state(self, index: int, state: Tensor) -> None:
        """The recurrent state after each prompt (the same on every rank)."""
        self._layer(index)
        self.cache.update_recurrent_state(state, index)

    # ------------------------------------------------------------------ decode
    def conv_state(self, index: int, state_idx: int = 0) -> Tensor:
        return self._required(index, state_idx, "convolution")

    def state(self, index: int) -> Tensor:
        return self._required(index, 0, "recurrent")

    def _required(self, index: int, state_idx: int, kind: str) -> Tensor:
        found = None
        if index < len(self.cache.layers):
            found = (self.cache.get_conv_state(index, state_idx) if kind == "convolution"
                     else self.cache.get_recurrent_state(index, state_idx))
        if found is None:  # never decode from a zero state
            raise RuntimeError(f"layer {index} has no {kind} state from the prefill: a decode "
                               "step would start from zeros")
        return found

    def nbytes(self) -> int:
        total = 0
        for layer in self.cache.layers:
            for t in (*layer.conv_states.values(), *layer.recurrent_states.values()):
                total += 0 if t is None else t.numel() * t.element_size()
        return total
