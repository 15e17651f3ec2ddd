"""prepare-data for image conversations: a vision-language model's processor expands each
conversation's images into placeholder tokens, and whole conversations are packed into
windows with their pixel values and grids beside the token ids.

A record is a conversation (``messages``: ``{"role", "content"}`` turns whose content is a
string or a list of ``{"type": "text", "text"}`` / ``{"type": "image"}`` parts) and its images
(``images``: file paths, relative to the input file's folder or absolute, or a ``datasets``
image column), one per image part, in order. Each conversation is rendered with the
processor's chat template and run through the processor (``AutoProcessor`` from a local
folder, no remote code), which gives the ids with every image's placeholder tokens expanded,
the pixel values and, for Qwen-style towers, the (T, H, W) grid of each image. The labels are
the ids on the assistant turns (found by prefixes, as for text chat data: :mod:`chat`), -100
elsewhere; the placeholders are never targets.

Packing keeps every conversation whole: an image must never be cut by a window edge (its
features are computed from all its patches), and the model's multimodal positions are
numbered per conversation. A conversation that does not fit in what is left of a window
starts the next one; the rest of the window is padding, a document of its own whose targets
are all -100 (attention never crosses a document edge, so it changes no other token's loss).
A conversation longer than a window is refused: raise ``--seq-length`` or split it.

Each window (row) holds ``input_ids``, ``labels``, ``position_ids`` (restarting at each
conversation and at the padding), ``document_ids`` (the conversation's index; -1 on padding),
``pixel_values`` (the window's images' pixel values, flat float32, in placeholder order),
``pixel_values_shape`` (their shape: (patches, dim) for Qwen, (images, C, H, W) for
fixed-size towers) and ``image_grid_thw`` (flat (images x 3); empty without grids). Arrow
columns throughout: nothing is pickled.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from datasets.arrow_writer import ArrowWriter

from .chat import IGNORE_INDEX, load_chat_template
from .pack import save_windows
from .sources import SourceSpec, open_source, parse_source

logger = logging.getLogger(__name__)

def load_vision_processor(path: str):
    """The processor in the local folder ``path`` (AutoProcessor, no remote code), or a
    ValueError when it is not a vision-language processor."""
    from transformers import AutoProcessor

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"--processor {path} is not a folder; pass the local folder of "
                                "a vision-language model with its processor files")
    try:
        processor = AutoProcessor.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ValueError(f"--processor {path} holds no vision-language processor that "
                         f"AutoProcessor can load ({type(e).__name__}: {e}); pass the folder of "
                         "a vision-language model with its processor files") from e
    if getattr(processor, "image_processor", None) is None or \
            getattr(processor, "tokenizer", None) is None:
        raise ValueError(f"--processor {path} holds a {type(processor).__name__}, not a "
                         "vision-language processor (an image processor and a tokenizer); pass "
                         "the folder of a vision-language model")
    if image_token_id(processor) is None:
        raise ValueError(f"--processor {path}: its {type(processor).__name__} names no image "
                         "token; pass the processor of a vision-language model")
    return processor


def image_token_id(processor) -> int | None:
    """The id of the processor's image placeholder token."""
    value = getattr(processor, "image_token_id", None)
    if value is None and getattr(processor, "image_token", None):
        value = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    return None if value is None or value == processor.tokenizer.unk_token_id else int(value)


def _image_parts(messages: list[dict]) -> list[int]:
    """Image parts per message."""
    return [sum(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
            if isinstance(m.get("content"), list) else 0 for m in messages]


def _clean(messages: Any, where: str, column: str) -> list[dict]:
    """The record's messages, validated; Arrow gives every part every key (None where absent)."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"{where}: column {column!r} is not a non-empty list of messages; each "
                         f'record needs {column!r}: [{{"role": ..., "content": ...}}, ...]')
    out = []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or \
                not isinstance(content, (str, list)):
            raise ValueError(f"{where}: message {i} is not a dict with a string 'role' and a "
                             f"string or list 'content' (got {m!r:.80}); fix the record")
        if isinstance(content, list):
            content = [{k: v for k, v in p.items() if v is not None} for p in content]
        out.append({"role": m["role"], "content": content})
    return out


@dataclass
class Conversation:
    """One conversation, processed: ids and labels (n,), pixel values and grids of its images."""

    ids: np.ndarray
    labels: np.ndarray
    pixel_values: np.ndarray      # (patches, dim) or (images, C, H, W); float32
    grid: np.ndarray | None       # (images, 3) int64, or None for fixed-size towers
    images: int


class ConversationProcessor:
    """Conversations with images -> :class:`Conversation`, through the model's processor."""

    def __init__(self, processor, template: str, base: Path | None = None) -> None:
        self.processor, self.template, self.base = processor, template, base
        self.image_id = image_token_id(processor)

    def _open(self, image, where: str):
        from PIL import Image

        if isinstance(image, Image.Image):
            return image.convert("RGB")
        if isinstance(image, dict) and image.get("bytes") is not None:  # datasets' raw Image
            import io

            return Image.open(io.BytesIO(image["bytes"])).convert("RGB")
        path = image.get("path") if isinstance(image, dict) else image
        if not isinstance(path, str):
            raise ValueError(f"{where}: an image is a {type(image).__name__}, not a file path or "
                             "an image; give paths, or a datasets Image column")
        return Image.open(self.resolve(path)).convert("RGB")

    def resolve(self, path: str) -> Path:
        p = Path(path).expanduser()
        return p if p.is_absolute() or self.base is None else self.base / p

    def _run(self, messages: list[dict], images: list, generation: bool) -> dict:
        text = self.processor.apply_chat_template(messages, chat_template=self.template,
                                                  tokenize=False,
                                                  add_generation_prompt=generation)
        return self.processor(text=[text], images=images or None, return_tensors="np")

    def __call__(self, messages: list[dict], images: list, where: str) -> Conversation:
        parts = _image_parts(messages)
        if sum(parts) != len(images):
            raise ValueError(f"{where}: its messages have {sum(parts)} image parts and its "
                             f"images column {len(images)} images; give one image per "
                             '{"type": "image"} part')
        pil = [self._open(image, where) for image in images]
        whole = self._run(messages, pil, False)
        ids = whole["input_ids"][0].astype(np.int64)
        learn = np.zeros(len(ids), dtype=bool)
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            if i == 0:
                raise ValueError(f"{where} starts with an assistant message, whose tokens "
                                 "cannot be found by prefixes; start it with a user or system "
                                 "message")
            seen = sum(parts[:i])
            before = self._run(messages[:i], pil[:seen], True)["input_ids"][0]
            upto = self._run(messages[:i + 1], pil[:seen + parts[i]], False)["input_ids"][0]
            if not (np.array_equal(upto[:len(before)], before)
                    and np.array_equal(ids[:len(upto)], upto)):
                raise ValueError(f"{where}: the chat template renders turn {i} differently once "
                                 "later turns follow, so its assistant tokens cannot be found "
                                 "by prefixes; pass a --chat-template that renders earlier "
                                 "turns the same way")
            learn[len(before):len(upto)] = True
        learn &= ids != self.image_id  # a placeholder is never a target
        pixels = whole.get("pixel_values")
        grid = whole.get("image_grid_thw")
        tokens = int((ids == self.image_id).sum())
        if pil:
            pixels = np.asarray(pixels, dtype=np.float32)
            grid = None if grid is None else np.asarray(grid, dtype=np.int64).reshape(-1, 3)
            _check_features(self.processor, tokens, len(pil), grid, where)
        else:
            pixels, grid = np.zeros((0,), np.float32), None
            if tokens:
                raise ValueError(f"{where} has {tokens} image tokens in its text and no images; "
                                 "write images as {\"type\": \"image\"} parts, not as the token")
        return Conversation(ids, np.where(learn, ids, IGNORE_INDEX), pixels, grid, len(pil))


def _check_features(processor, tokens: int, images: int, grid: np.ndarray | None,
                    where: str) -> None:
    """The placeholders the processor wrote match its images' features: the grids' patches
    over the merge (Qwen), or as many tokens per image (fixed-size towers)."""
    if grid is not None:
        merge = int(getattr(processor.image_processor, "merge_size", 1) or 1) ** 2
        want = int(grid.prod(-1).sum()) // merge
        if grid.shape[0] != images or want != tokens:
            raise ValueError(f"{where}: the processor wrote {tokens} image tokens for "
                             f"{grid.shape[0]} grids of {want} features ({images} images); "
                             "the processor does not match its image processor")
    elif tokens % images:
        raise ValueError(f"{where}: {tokens} image tokens do not split evenly over {images} "
                         "images; the processor's images are not of one fixed size")


class ConversationPacker:
    """Whole conversations into windows of ``window`` tokens, each padded at its end."""

    def __init__(self, window: int, pad_id: int) -> None:
        self.window, self.pad_id = window, pad_id
        self.rows: list[dict] = []
        self._parts: list[tuple[int, Conversation]] = []
        self._used = 0
        self.padding = self.conversations = self.images = 0

    def add(self, index: int, conv: Conversation, where: str) -> list[dict]:
        """Add a conversation; return the windows it closed."""
        n = len(conv.ids)
        if n > self.window:
            raise ValueError(f"{where} has {n} tokens (its image tokens included), more than a "
                             f"window of {self.window} (--seq-length + 1); an image must not be "
                             f"cut, so raise --seq-length to at least {n - 1}, or split the "
                             "conversation")
        out = []
        if self._used + n > self.window:
            out.append(self._close())
        self._parts.append((index, conv))
        self._used += n
        self.conversations += 1
        self.images += conv.images
        return out

    def finish(self) -> list[dict]:
        return [self._close()] if self._parts else []

    def _close(self) -> dict:
        ids, labels, positions, docs, pixels, grids, shapes = [], [], [], [], [], [], []
        for index, conv in self._parts:
            ids.append(conv.ids)
            labels.append(conv.labels)
            positions.append(np.arange(len(conv.ids)))
            docs.append(np.full(len(conv.ids), index))
            if conv.images:
                pixels.append(conv.pixel_values)
                shapes.append(conv.pixel_values.shape)
                if conv.grid is not None:
                    grids.append(conv.grid)
        pad = self.window - self._used
        if pad:
            ids.append(np.full(pad, self.pad_id))
            labels.append(np.full(pad, IGNORE_INDEX))
            positions.append(np.arange(pad))
            docs.append(np.full(pad, -1))
            self.padding += pad
        values = np.concatenate(pixels) if pixels else np.zeros((0,), np.float32)
        row = {"input_ids": np.concatenate(ids).astype(np.int64),
               "labels": np.concatenate(labels).astype(np.int64),
               "position_ids": np.concatenate(positions).astype(np.int32),
               "document_ids": np.concatenate(docs).astype(np.int64),
               "pixel_values": values.reshape(-1).astype(np.float32),
               "pixel_values_shape": np.asarray(values.shape, dtype=np.int64),
               "image_grid_thw": (np.concatenate(grids).reshape(-1) if grids
                                  else np.zeros(0, np.int64))}
        self._parts, self._used = [], 0
        return row


def _features(window: int) -> datasets.Features:
    fixed = lambda dtype: datasets.Sequence(datasets.Value(dtype), length=window)  # noqa: E731
    return datasets.Features({
        "input_ids": fixed("int64"), "labels": fixed("int64"), "position_ids": fixed("int32"),
        "document_ids": fixed("int64"),
        "pixel_values": datasets.Sequence(datasets.Value("float32")),
        "pixel_values_shape": datasets.Sequence(datasets.Value("int64")),
        "image_grid_thw": datasets.Sequence(datasets.Value("int64"))})


def _records(ds, spec: SourceSpec) -> Iterator[tuple[dict, str]]:
    for row, record in enumerate(ds):
        yield record, f"input {spec.path}, document {row}"


def _check_images(ds, spec: SourceSpec, cfg, conv: ConversationProcessor) -> int:
    """Every image file of the source exists (before any is processed); the number of images."""
    column = ds.select_columns([cfg.images_column])
    if "Image(" in repr(ds.features[cfg.images_column]):
        # a datasets image column holds the images themselves: nothing to look for
        return sum(len(images or []) for images in column.cast_column(
            cfg.images_column, datasets.List(datasets.Image(decode=False)))[cfg.images_column])
    count = 0
    for record, where in _records(column, spec):
        images = record[cfg.images_column] or []
        if not isinstance(images, (list, tuple)):
            raise ValueError(f"{where}: column {cfg.images_column!r} holds a "
                             f"{type(images).__name__}, not a list of images; pass "
                             "--images-column naming a list of image paths")
        for image in images:
            path = image.get("path") if isinstance(image, dict) and image.get("bytes") is None \
                else image
            if isinstance(path, str) and not conv.resolve(path).is_file():
                raise FileNotFoundError(f"{where}: image file {conv.resolve(path)} does not "
                                        "exist; fix the path (relative paths are read from the "
                                        "input file's folder)")
        count += len(images)
    return count


def prepare_vision_data(cfg) -> dict:
    """prepare-data with ``cfg.processor``: the pipeline above; returns the stats written to
    ``<output>/stats.json``. ``cfg`` is a :class:`~easy_context.data.prepare.PrepareConfig`
    (prepare_data has checked the output folder)."""
    t0 = time.perf_counter()
    out = Path(cfg.output).expanduser()
    specs = [parse_source(s) for s in cfg.inputs]
    for spec in specs:
        if spec.kind == "text":
            raise ValueError(f"input {spec.path} is plain text; image conversations need "
                             ".jsonl/.json/.parquet files or a saved dataset, a record each")
    processor = load_vision_processor(cfg.processor)
    template = load_chat_template(processor, cfg.chat_template)
    # open every source and check its columns and image files before any work
    opened = []
    for spec in specs:
        ds = open_source(spec, [cfg.messages_column, cfg.images_column],
                         "--messages-column/--images-column", False, cfg.max_documents)
        base = Path(spec.files[0]).parent if spec.files else None
        conv = ConversationProcessor(processor, template, base)
        opened.append((spec, ds, conv, _check_images(ds, spec, cfg, conv)))
    window = cfg.seq_length + 1
    tokenizer = processor.tokenizer
    pad_id = next((t for t in (tokenizer.pad_token_id, tokenizer.eos_token_id) if t is not None), 0)
    packer = ConversationPacker(window, pad_id)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    per_source, index, label_tokens = [], 0, 0
    try:
        with ArrowWriter(features=_features(window), path=str(work / "windows.arrow")) as writer:
            for spec, ds, conv, images in opened:
                start, tokens = index, 0
                for record, where in _records(ds, spec):
                    messages = _clean(record[cfg.messages_column], where, cfg.messages_column)
                    item = conv(messages, list(record[cfg.images_column] or []), where)
                    tokens += len(item.ids)
                    label_tokens += int((item.labels != IGNORE_INDEX).sum())
                    for row in packer.add(index, item, where):
                        writer.write(row)
                    index += 1
                per_source.append({"name": spec.name, "path": spec.path,
                                   "documents": index - start, "images": images,
                                   "tokens": tokens})
            for row in packer.finish():
                writer.write(row)
            windows, _ = writer.finalize()
        if index == 0:
            raise ValueError("the inputs hold no conversations; check the files or "
                             "--max-documents")
        save_windows(work / "windows.arrow", out, cfg.shuffle, cfg.seed, cfg.max_shard_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    stats = {"seq_length": cfg.seq_length, "window": window, "windows": windows,
             "documents": index, "images": packer.images,
             "tokens": sum(s["tokens"] for s in per_source), "padding_tokens": packer.padding,
             "label_tokens_in_windows": label_tokens, "processor": type(processor).__name__,
             "image_token_id": image_token_id(processor),
             "seconds": round(time.perf_counter() - t0, 3), "sources": per_source}
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    (out / "prepare_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2,
                                                        default=str))
    logger.info("wrote %d windows of %d tokens (%d conversations, %d images) to %s", windows,
                window, index, packer.images, out)
    return stats
