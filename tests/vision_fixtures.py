"""Tiny vision-language checkpoints with their processors, images and conversations on disk,
for the CLI's vision path (prepare-data, train): no downloads.

The tokenizer is a word-level one: the words "3".."88" are ids 3..88, and the special tokens
the chat template and the processor write have ids of their own; the models are
tests/dist/vlm_cases.py's tiny ones (vocab 97, hidden 32, 2 layers; 2x2 patches)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# Qwen's placeholder and frame tokens (vlm_cases.SPECIAL), and the chat template's words
IMAGE, VIDEO, VISION_START, VISION_END = 90, 91, 92, 93
IM_START, IM_END = 94, 95

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} "
    "{% if m['content'] is string %}{{ m['content'] }} "
    "{% else %}{% for part in m['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|> "
    "{% elif part['type'] == 'text' %}{{ part['text'] }} {% endif %}"
    "{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
LLAVA_TEMPLATE = CHAT_TEMPLATE.replace(
    "<|vision_start|><|image_pad|><|vision_end|>", "<image>")


def _tokenizer(image_words: dict[str, int]):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(3, 89)}
    vocab.update({"<pad>": 0, "<unk>": 1, "<eos>": 2, "user": 88, "assistant": 89,
                  "<|im_start|>": IM_START, "<|im_end|>": IM_END, **image_words})
    vocab = {w: i for w, i in vocab.items() if not (w == "88" and i == 88)}
    words = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="<eos>",
                                   pad_token="<pad>",
                                   additional_special_tokens=list(image_words)
                                   + ["<|im_start|>", "<|im_end|>"])


def _qwen_images_processor():
    """Qwen2.5-VL's processor without its video processor, which needs torchvision (not
    installed here): the image expansion is Qwen2_5_VLProcessor's own. Registered with
    AutoProcessor (in this process) for Qwen2.5-VL configs, so that a saved folder loads."""
    from transformers import AutoProcessor, Qwen2_5_VLConfig, Qwen2_5_VLProcessor

    class QwenImagesProcessor(Qwen2_5_VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template,
                             **kwargs)

    QwenImagesProcessor.__module__ = __name__
    AutoProcessor.register(Qwen2_5_VLConfig, QwenImagesProcessor, exist_ok=True)
    return QwenImagesProcessor


def qwen_processor():
    """A Qwen2.5-VL processor: 2x2 patches, 2x2 merge, images of 4..16 x 4..16 pixels."""
    from transformers import Qwen2VLImageProcessorPil

    tok = _tokenizer({"<|image_pad|>": IMAGE, "<|video_pad|>": VIDEO,
                      "<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END})
    sizes = dict(patch_size=2, temporal_patch_size=1, merge_size=2,
                 size={"shortest_edge": 16, "longest_edge": 256})
    # images only: Qwen's video processor needs torchvision
    return _qwen_images_processor()(image_processor=Qwen2VLImageProcessorPil(**sizes), tokenizer=tok,
                               chat_template=CHAT_TEMPLATE)


def llava_processor():
    """A LLaVA processor: 4x4 images of 2x2 patches, 4 tokens each (CLS dropped)."""
    from transformers import CLIPImageProcessor, LlavaProcessor

    tok = _tokenizer({"<image>": IMAGE})
    images = CLIPImageProcessor(size={"shortest_edge": 4}, crop_size={"height": 4, "width": 4})
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=2,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token="<image>", chat_template=LLAVA_TEMPLATE)


def tiny_vlm_dir(folder: Path, family: str = "qwen2_5_vl", seed: int = 0) -> Path:
    """vlm_cases.tiny_vlm(family) and its processor, saved with save_pretrained."""
    from tests.dist.vlm_cases import tiny_vlm

    model = tiny_vlm(family, seed)
    model.config.tie_word_embeddings = False
    model.save_pretrained(folder, safe_serialization=True)
    (qwen_processor() if family.startswith("qwen") else llava_processor()).save_pretrained(folder)
    return Path(folder)


def write_images(folder: Path, sizes: list[tuple[int, int]], seed: int = 0) -> list[str]:
    """PNG files of random pixels, (height, width) each; their file names."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for i, (h, w) in enumerate(sizes):
        name = f"img{i}.png"
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(folder / name)
        names.append(name)
    return names


def conversations(images: list[str], seed: int = 0, n: int = 6) -> list[dict]:
    """``n`` conversations: a user turn with 0-2 images among words, an assistant answer
    (contents as lists of parts: an Arrow column takes one type)."""
    rng = np.random.default_rng(seed)
    words = lambda k: " ".join(str(x) for x in rng.integers(3, 88, k))  # noqa: E731
    out = []
    for i in range(n):
        mine = [images[(i + j) % len(images)] for j in range(i % 3)]
        content = [{"type": "text", "text": words(3 + i % 2)}]
        for name in mine:
            content += [{"type": "image"}, {"type": "text", "text": words(2)}]
        out.append({"messages": [{"role": "user", "content": content},
                                 {"role": "assistant",
                                  "content": [{"type": "text", "text": words(4 + i % 3)}]}],
                    "images": mine})
    return out


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


SEQ_LENGTH = 64  # windows of 65 tokens: 2-rank zigzag shards cut at 16, 32 and 48


def vision_workdir(root: Path) -> dict[str, Path]:
    """Tiny Qwen2.5-VL and LLaVA folders (model + processor), PNG images of three sizes,
    six conversations as jsonl (image paths relative to it), and the same conversations as
    a saved dataset with a datasets image column."""
    import datasets

    root = Path(root)
    qwen = tiny_vlm_dir(root / "qwen", "qwen2_5_vl")
    llava = tiny_vlm_dir(root / "llava", "llava")
    images = write_images(root / "data", [(8, 8), (8, 12), (12, 8)])
    records = conversations(images)
    jsonl = write_jsonl(root / "data" / "conv.jsonl", records)
    from PIL import Image

    saved = root / "saved"
    datasets.Dataset.from_list([
        {"messages": r["messages"],
         "images": [Image.open(root / "data" / name) for name in r["images"]]}
        for r in records], features=datasets.Features({
            "messages": datasets.List({"role": datasets.Value("string"),
                                       "content": datasets.List({
                                           "type": datasets.Value("string"),
                                           "text": datasets.Value("string")})}),
            "images": datasets.List(datasets.Image())})).save_to_disk(str(saved))
    return {"root": root, "qwen": qwen, "llava": llava, "jsonl": jsonl, "saved": saved}
