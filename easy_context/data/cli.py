"""Argparse entry points for the data commands; ``easy_context/cli.py`` wires them up as

    easy-context prepare-data    INPUT... --tokenizer TOK --output-dir DIR --seq-length N
    easy-context synth-data      --kind mix --num-docs N --length L --output FILE.jsonl
    easy-context train-tokenizer --input FILE_OR_DIR... --vocab-size V --output-dir DIR

A folder output is ``--output-dir`` everywhere (``--output`` still works, as before); a file
output is ``--output``.

Bad flag values raise ValueError / FileNotFoundError saying what to change, before any
long work starts; ``easy_context/cli.py`` prints them as one line.

Each command is an ``add_*_args(parser)`` / ``run_*(args) -> int`` pair so it can be
mounted as a subcommand or tested without a subprocess.

Inputs of prepare-data may be named ``name=path``; the name labels the source in
stats.json and is the unit of per-source upsampling (default: the file or folder name).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

# Only the light module at the top: the others import datasets, tokenizers and transformers,
# which synth-data never needs (each command imports what it runs).
from .synthetic import KINDS, SyntheticConfig, generate

logger = logging.getLogger(__name__)


def add_prepare_data_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``easy-context prepare-data``."""
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text file or folder, .jsonl/.parquet file or folder, save_to_disk "
                             "folder, or dataset name; optionally name=path to label the source")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder or name (AutoTokenizer); required unless --processor")
    parser.add_argument("--output-dir", "--output", dest="output", required=True, metavar="DIR",
                        help="output folder (datasets.save_to_disk)")
    parser.add_argument("--seq-length", type=int, default=8192,
                        help="training sequence length; windows hold seq_length + 1 tokens")
    parser.add_argument("--text-column", default="text", help="text column of jsonl/parquet/datasets")
    parser.add_argument("--add-bos", action=argparse.BooleanOptionalAction, default=True,
                        help="prepend BOS to each document (skipped if the tokenizer has none)")
    parser.add_argument("--add-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="append EOS to each document")
    parser.add_argument("--min-length", type=int, default=0,
                        help="drop documents with fewer tokens than this")
    parser.add_argument("--upsample-threshold", type=int, default=None,
                        help="enable per-source length upsampling: documents shorter than this "
                             "many tokens are 'short' (Fu et al. 2024)")
    parser.add_argument("--upsample-keep-prob", type=float, default=0.3,
                        help="probability of keeping a short document when upsampling")
    parser.add_argument("--num-proc", type=int, default=1, help="tokenizer worker processes")
    parser.add_argument("--streaming", action="store_true",
                        help="read inputs lazily, for corpora larger than RAM (same result)")
    parser.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True,
                        help="shuffle the packed windows by --seed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow custom tokenizer code from the hub (runs remote code)")
    parser.add_argument("--max-documents", type=int, default=None,
                        help="read at most this many documents per source")
    chat = parser.add_argument_group(
        "chat data", "records are conversations, rendered with the tokenizer's chat template; "
        "a labels column trains on the assistant turns only (-100 elsewhere)")
    chat.add_argument("--chat", action="store_true",
                      help="read conversations from --messages-column")
    chat.add_argument("--messages-column", default="messages",
                      help='column holding a list of {"role", "content"} messages')
    chat.add_argument("--prompt-column", default=None,
                      help="single-turn data: prompt column (implies --chat; with --response-column)")
    chat.add_argument("--response-column", default=None, help="single-turn data: response column")
    chat.add_argument("--chat-template", default=None, metavar="FILE",
                      help="Jinja chat template file, for a tokenizer without one (or to replace "
                           "it); {%% generation %%} tags around assistant text are used when present")
    vision = parser.add_argument_group(
        "image conversations", "records are conversations with images, run through a "
        "vision-language model's processor (images expanded into their placeholder tokens) and "
        "packed whole, with their pixel values and grids")
    vision.add_argument("--processor", default=None, metavar="DIR",
                        help="local folder of the model's processor (AutoProcessor, no remote "
                             "code); implies --chat")
    vision.add_argument("--images-column", default="images",
                        help="column holding each record's images: file paths (relative to "
                             "the input file's folder) or a datasets image column")


def run_prepare_data(args: argparse.Namespace) -> int:
    """Run prepare-data from parsed flags; print a one-line summary; return 0."""
    from .prepare import PrepareConfig, prepare_data
    from .upsample import UpsampleConfig

    if args.tokenizer is None and args.processor is None:
        raise ValueError("pass --tokenizer (text data) or --processor (image conversations)")
    if args.tokenizer is not None and args.processor is not None:
        raise ValueError("--processor brings its own tokenizer; drop --tokenizer")
    cfg = PrepareConfig(
        inputs=list(args.inputs), tokenizer=args.tokenizer or args.processor, output=args.output,
        seq_length=args.seq_length, text_column=args.text_column, add_bos=args.add_bos,
        add_eos=args.add_eos, min_length=args.min_length,
        upsample=UpsampleConfig(args.upsample_threshold, args.upsample_keep_prob),
        num_proc=args.num_proc, streaming=args.streaming, shuffle=args.shuffle, seed=args.seed,
        trust_remote_code=args.trust_remote_code, max_documents=args.max_documents,
        chat=args.chat, messages_column=args.messages_column, prompt_column=args.prompt_column,
        response_column=args.response_column, chat_template=args.chat_template,
        processor=args.processor, images_column=args.images_column,
    )
    stats = prepare_data(cfg)
    images = f", {stats['images']} images" if cfg.processor is not None else ""
    print(f"wrote {stats['windows']} windows x {stats['window']} tokens "
          f"({stats['documents']} documents{images}, {stats['tokens']} tokens) to {cfg.output}")
    return 0


def add_synthetic_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``easy-context synth-data``."""
    parser.add_argument("--kind", choices=KINDS + ("mix",), default="mix")
    parser.add_argument("--num-docs", type=int, default=100)
    parser.add_argument("--length", type=int, default=4000, help="document length (see --length-unit)")
    parser.add_argument("--length-unit", choices=("chars", "tokens"), default="chars",
                        help="tokens are approximate: 4 characters each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", required=True, help="output .jsonl file")


def run_synthetic(args: argparse.Namespace) -> int:
    """Write a synthetic corpus as jsonl: one record (text, question, answer, ...) per line."""
    cfg = SyntheticConfig(kind=args.kind, num_docs=args.num_docs, length=args.length,
                          length_unit=args.length_unit, seed=args.seed)
    out = Path(args.output)
    if out.is_dir():
        raise ValueError(f"synth-data --output {out} is a folder; pass a file path such as "
                         f"{out / 'corpus.jsonl'}")
    out.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with out.open("w", encoding="utf-8") as f:
        for record in generate(cfg):
            f.write(json.dumps(record) + "\n")
            n += 1
    print(f"wrote {n} {cfg.kind} documents to {out}")
    return 0


def add_train_tokenizer_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``easy-context train-tokenizer``."""
    parser.add_argument("--input", nargs="+", required=True,
                        help="text files or folders to train on (each file read whole)")
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--text-column", default="text",
                        help="field holding the text in .jsonl/.json/.parquet inputs")
    parser.add_argument("--output-dir", "--output", dest="output", required=True, metavar="DIR",
                        help="tokenizer folder to write")


def run_train_tokenizer(args: argparse.Namespace) -> int:
    """Train a byte-level BPE on the input files and save it as a Hugging Face tokenizer."""
    from .tokenizer import check_vocab_size, iter_text_files, list_text_files, train_bpe_tokenizer

    check_vocab_size(args.vocab_size)
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise ValueError(f"train-tokenizer output {out} is a file; pass --output-dir a folder path")
    files = list_text_files(args.input)  # checks the inputs before training starts
    tok = train_bpe_tokenizer(iter_text_files(files, args.text_column), args.vocab_size, out)
    print(f"wrote a {len(tok)}-token byte-level BPE tokenizer to {out}")
    return 0
