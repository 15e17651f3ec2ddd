"""EasyContext: exact sequence-parallel long-context training for Hugging Face causal LMs."""

__version__ = "0.1.0"
