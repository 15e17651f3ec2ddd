"""What each recurrent layer kind says about itself, in one place (as parallel/method.py does
for the attention methods): its distributed functions and what it exchanges per layer.

Every kind runs on the same pieces (pieces.py) under every sequence-parallel method, with the
method's layout: the head-parallel methods (Ulysses, USP's Ulysses part) could instead run a
recurrent layer unchanged on whole-sequence heads after an all-to-all, but that moves every
token's activations (O(S)), while the scan moves one state map per piece (O(1) in the
sequence length), so the scan serves them too.

Bytes, per layer and per sequence (batch row), that one rank sends, forward and backward
(an all-gather or reduce-scatter sends a rank's part to the N-1 others):

- scan (scan.py): each piece's transition A and offset B in float32, all-gathered in forward,
  their gradients reduce-scattered in backward: ``2 (N-1) P |A + B| 4``, P the rank's pieces
  (1 contiguous, 2 zigzag, 1-2 usp). Gated delta rule: ``|A + B| = H_v d_k (d_k + d_v)``;
  Mamba-2: ``H N (N + P_h)`` (N the state size, P_h the head dim: the scalar decay kept as an
  N x N matrix, as scan.py carries any transition); KDA
  (Kimi Linear), the gated delta rule with a per-channel gate: ``H d_k (d_k + d_v)``;
  Mamba-1 (Jamba, selective_scan.py): ``2 D N`` (D = d_inner channels: an elementwise decay
  and an offset per channel and state entry).
- causal conv halo (conv.py): each piece's last K-1 inputs, gathered in forward, their
  gradients reduce-scattered in backward: ``2 (N-1) P C (K-1) a`` (C channels, a bytes per
  element).
- packed documents, forward only: ``(N-1) P (2 + K-1) 8`` bytes of int64 ids.

Next to attention: a ring sends ``3 (N-1) S 2 H_kv D a`` per layer (S local tokens), growing
with the sequence. With Qwen3NextConfig's defaults (linear layers: H_v 32, H_k 16, d_k = d_v =
128, conv channels 8192, K 4; attention: H_kv 2, D 256; bf16) a linear layer sends
2 (N-1) x 4.05 MiB per piece whatever the length, an attention layer 3 (N-1) x 2 KiB per local
token: the linear layer sends less from about 1.4K local tokens per piece on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from .conv import causal_conv1d
from .delta_rule import chunk_gated_delta_rule
from .mamba2 import mamba2_chunk_scan
from .selective_scan import selective_scan

INDEX_BYTES = 8


class MixerDims(NamedTuple):
    """The shape of one recurrent layer, as the cost functions need it."""

    state: int  # float32 elements of one piece's (A, B) per sequence, over all heads
    conv_channels: int  # 0: no convolution
    conv_kernel: int


@dataclass(frozen=True)
class Mixer:
    """One recurrent layer kind (see the module docstring)."""

    name: str
    summary: str
    scan: Callable[..., object] | None
    """The distributed recurrence (kernel signature plus kernel=, group=, layout=,
    ring_degree=, document_ids=), or None (a convolution-only layer)."""
    dims: Callable[..., MixerDims]
    """(**the layer's sizes) -> MixerDims."""

    def comm_bytes(self, dims: MixerDims, pieces: int, a: int, world: int,
                   documents: bool = False) -> int:
        """Bytes one rank sends per layer and sequence, forward and backward, with ``pieces``
        pieces per rank and ``a`` bytes per activation element."""
        halo = max(dims.conv_kernel - 1, 0) if dims.conv_channels else 0
        sent = 2 * (world - 1) * pieces * (dims.state * 4 + dims.conv_channels * halo * a)
        if documents:
            sent += (world - 1) * pieces * (2 + halo) * INDEX_BYTES
        return sent


def _delta_dims(k_heads: int, v_heads: int, dk: int, dv: int, conv_kernel: int) -> MixerDims:
    return MixerDims(v_heads * dk * (dk + dv), 2 * k_heads * dk + v_heads * dv, conv_kernel)


def _mamba2_dims(heads: int, head_dim: int, groups: int, state: int,
                 conv_kernel: int) -> MixerDims:
    return MixerDims(heads * state * (state + head_dim), heads * head_dim + 2 * groups * state,
                     conv_kernel)


def _kda_dims(heads: int, dk: int, dv: int, conv_kernel: int) -> MixerDims:
    # KDA: one head count for q, k and v (the conv runs over all three)
    return _delta_dims(heads, heads, dk, dv, conv_kernel)


def _selective_dims(channels: int, state: int, conv_kernel: int) -> MixerDims:
    # a (D, N) decay and a (D, N) offset per piece; the conv runs over the D scan inputs
    return MixerDims(2 * channels * state, channels, conv_kernel)


def _conv_dims(channels: int, conv_kernel: int) -> MixerDims:
    return MixerDims(0, channels, conv_kernel)


GATED_DELTA_NET = Mixer(
    "gated_delta_net", "gated DeltaNet (Qwen3-Next, Qwen3.5, OLMo hybrid): causal conv, then "
    "the gated delta rule; d_k x d_k transition per value head", chunk_gated_delta_rule,
    _delta_dims)
MAMBA2 = Mixer(
    "mamba2", "Mamba-2 (Bamba, Granite 4 hybrids, Nemotron-H, Falcon-H1, Zamba2): causal conv, "
    "then the SSD scan; a scalar decay per head", mamba2_chunk_scan, _mamba2_dims)
KDA = Mixer(
    "kda", "Kimi Delta Attention (Kimi Linear): causal conv, then the gated delta rule with a "
    "per-channel gate; d_k x d_k transition per head", chunk_gated_delta_rule, _kda_dims)
MAMBA1 = Mixer(
    "mamba1", "Mamba-1 (Jamba): causal conv, then the selective scan; a decay per channel and "
    "state entry, elementwise", selective_scan, _selective_dims)
SHORT_CONV = Mixer(
    "short_conv", "short gated causal convolutions (LFM2): the halo only", None, _conv_dims)

MIXERS: dict[str, Mixer] = {m.name: m for m in (GATED_DELTA_NET, MAMBA2, KDA, MAMBA1,
                                                 SHORT_CONV)}
CONV = causal_conv1d
