"""Data for long-context training: prepare (read, tokenize, upsample, pack), synthetic
corpora, tokenizer training, and the PoSE collator.

    from easy_context.data import PrepareConfig, prepare_data
    stats = prepare_data(PrepareConfig(inputs=["corpus/"], tokenizer="tok/", output="packed/",
                                       seq_length=8192))
    ds = datasets.load_from_disk("packed/")   # input_ids, position_ids, document_ids

Chat data (``PrepareConfig(chat=True, ...)``: a ``messages`` column, or ``prompt_column`` and
``response_column``) is rendered with the chat template and gets a ``labels`` column too:
the token on assistant turns, -100 elsewhere.
"""

from ..utils.lazy import lazy_exports

# Imported on first use: synth-data needs none of datasets, tokenizers or transformers.
_EXPORTS = {
    "IGNORE_INDEX": "chat", "ChatColumns": "chat", "ChatTokenizer": "chat",
    "load_chat_template": "chat", "Packer": "pack", "PackedBatch": "pack",
    "PoSECollator": "pose", "PoSEConfig": "pose", "pose_position_ids": "pose",
    "PrepareConfig": "prepare", "prepare_data": "prepare", "SourceSpec": "sources",
    "load_source": "sources", "parse_source": "sources", "SyntheticConfig": "synthetic",
    "generate": "synthetic", "generate_texts": "synthetic", "SpecialTokens": "tokenize",
    "load_tokenizer": "tokenize", "resolve_special_tokens": "tokenize",
    "train_bpe_tokenizer": "tokenizer", "UpsampleConfig": "upsample",
    "length_histogram": "upsample", "plan_copies": "upsample",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

__all__ = list(_EXPORTS)
