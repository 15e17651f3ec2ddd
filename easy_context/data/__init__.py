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

from .chat import IGNORE_INDEX, ChatColumns, ChatTokenizer, load_chat_template
from .pack import Packer, PackedBatch
from .pose import PoSECollator, PoSEConfig, pose_position_ids
from .prepare import PrepareConfig, prepare_data
from .sources import SourceSpec, load_source, parse_source
from .synthetic import SyntheticConfig, generate, generate_texts
from .tokenize import SpecialTokens, load_tokenizer, resolve_special_tokens
from .tokenizer import train_bpe_tokenizer
from .upsample import UpsampleConfig, length_histogram, plan_copies

__all__ = [
    "IGNORE_INDEX", "ChatColumns", "ChatTokenizer", "load_chat_template",
    "Packer", "PackedBatch", "PoSECollator", "PoSEConfig", "pose_position_ids", "PrepareConfig",
    "prepare_data", "SourceSpec", "load_source", "parse_source", "SyntheticConfig", "generate",
    "generate_texts", "SpecialTokens", "load_tokenizer", "resolve_special_tokens",
    "train_bpe_tokenizer", "UpsampleConfig", "length_histogram", "plan_copies",
]
