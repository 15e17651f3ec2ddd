"""Sequence-parallel generation: prefill with any method, a KV cache sharded over the ranks,
decode steps merged across them (generate.py; the cache in cache.py, one step's attention in
decode_attention.py, token choice and stopping in sampling.py; ``easy-context generate`` in
cli.py)."""

from .generate import GenerationResult, generate

__all__ = ["generate", "GenerationResult"]
