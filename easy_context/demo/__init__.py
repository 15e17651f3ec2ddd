"""``easy-context demo``: a tiny Llama learns retrieval at 512 tokens, then a progressive RoPE
recipe extends it to 2048 with zigzag ring attention on 2 CPU processes; needle and
perplexity before and after, in a Markdown report with figures."""

from .run import DemoSettings, run_demo_pipeline

__all__ = ["DemoSettings", "run_demo_pipeline"]
