"""Recurrent layers (linear attention, state-space models, short convolutions) over sequence
shards: exact, with one small collective per layer instead of passing state rank to rank.

- pieces.py: where every rank's tokens sit in the sequence, from the layout alone.
- scan.py: a linear recurrence whose pieces map the state affinely, chained in sequence order.
- delta_rule.py, mamba2.py: the gated delta rule and Mamba-2's SSD as such recurrences.
- conv.py: the causal depthwise convolution before them (each piece's halo).
"""
