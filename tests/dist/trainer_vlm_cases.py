"""Rank functions for vision-language models in transformers' Trainer (test_trainer_vlm.py).

One optimizer step of a tiny vision-language model (vlm_cases.tiny_vlm) on one batch of the
keys that TRL's DataCollatorForVisionLanguageModeling produces: input_ids, attention_mask
(right padding), labels (input_ids, -100 on the padding), pixel_values, and for Qwen
image_grid_thw and mm_token_type_ids. Images straddle the shard boundaries of the 2-rank
layouts (12 and 36 for zigzag, 24 for contiguous shards). The gradients are read before the
optimizer (after DDP's reduction: the vision tower's like every replicated parameter's), so
each is compared whole, not through a weight update.
"""

from __future__ import annotations

import copy

import torch

from easy_context.integrations.vision import tower_sharded

from .trainer_cases import _env_for_accelerate
from .vlm_cases import IMAGE, VIDEO, make_step, tiny_vlm

PAD_FROM = 44  # row 0 is padded from here (its images end at 16)


def vlm_batch(family: str, seed: int = 1, video: bool = False) -> dict:
    """The collator's batch: two rows of 48 tokens, five images (rows 0, 0, 1, 1, 1);
    ``video`` (Qwen): the third a video of two frames (row 1, tokens 22-25)."""
    step = make_step(family, batch=2, seed=seed, video=video)
    ids = step["input_ids"].clone()
    mask = torch.ones_like(ids)
    ids[0, PAD_FROM:] = 0
    mask[0, PAD_FROM:] = 0
    labels = ids.clone()  # as TRL's collator: the ids, -100 on the padding
    labels[mask == 0] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels,
             "pixel_values": step["pixel_values"]}
    for key in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        if key in step:
            batch[key] = step[key]
    if family == "gemma3":  # its processor's image marks
        batch["token_type_ids"] = (ids == IMAGE).long()
    if family == "gemma4":  # its processor's image marks and patch positions
        batch["mm_token_type_ids"] = (ids == IMAGE).long()
        batch["image_position_ids"] = step["image_position_ids"]
    if "image_grid_thw" in step:  # a Qwen processor's keys
        batch["image_grid_thw"] = step["image_grid_thw"]
        batch["mm_token_type_ids"] = (ids == IMAGE).long() + 2 * (ids == VIDEO).long()
    return batch


def anyres_batch(family: str) -> dict:
    """A collator's batch for a tower that takes image_sizes (vlm_cases.make_anyres_step):
    one row of 64 tokens, three images of different sizes, each across a 2-rank boundary."""
    from .vlm_cases import make_anyres_step

    step = make_anyres_step(tiny_vlm(family), family)
    ids = step["input_ids"]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
            "pixel_values": step["pixel_values"], "image_sizes": step["image_sizes"]}


def vlm_trainer_anyres(folder: str, family: str, method: str | None) -> dict:
    """vlm_trainer_step on anyres_batch (``method`` None: the one-process reference)."""
    return vlm_trainer_step(folder, family, method, batch=anyres_batch(family))


class _Batches(torch.utils.data.Dataset):
    """Collated batches, one per item (the test's collator hands each on as it is)."""

    def __init__(self, *batches: dict):
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> dict:
        return self.batches[i]


def _collate(items: list[dict]) -> dict:
    return {k: v.clone() for k, v in items[0].items()}


def vlm_trainer_step(folder: str, family: str, method: str | None,
                     batch: dict | None = None, break_vision: bool = False,
                     engine: str = "ddp", sp_size: int | None = None, accum: int = 1,
                     lora: bool = False, evaluate_only: bool = False,
                     second: dict | None = None, max_length: dict | None = None) -> dict:
    """One Trainer step; returns the logged loss, grad norm and every parameter's gradient
    before the optimizer. ``method=None``: the one-process reference (the model's own
    forward and loss). ``break_vision``: a scratch break that hides the images from the
    sequence-parallel loss (the test must then fail). ``second``: the second batch (another
    data-parallel group's, or the second accumulated), instead of vlm_batch's seed 2.
    ``max_length``: enable_sequence_parallel's max-length keywords (mlp_tile, head_chunk,
    checkpointing), max_length=True."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    _env_for_accelerate()
    model = tiny_vlm(family)
    if lora:  # adapters on the text decoder's attention, the tower frozen (a PeftModel)
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(5)
        model = get_peft_model(model, LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0,
            target_modules=r".*language_model.*\.(q_proj|v_proj)"))
        for name, p in model.named_parameters():  # B nonzero: A's gradients too
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
    grads: dict = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for name, p in kwargs["model"].named_parameters():
                grads[name] = _whole_grad(p, engine)

    args = TrainingArguments(
        output_dir=f"{folder}/vlm-{family}-{method}", per_device_train_batch_size=1,
        max_steps=1, learning_rate=0.1, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1e9, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=3, disable_tqdm=True, remove_unused_columns=False, bf16=False,
        gradient_accumulation_steps=accum, **_engine_args(engine))
    # two data-parallel groups (or accumulation 2 in one process): a second batch
    two = sp_size is not None or accum > 1
    data = _Batches(*([batch if batch is not None else vlm_batch(family)]
                      + ([second if second is not None else vlm_batch(family, seed=2)]
                         if two else [])))
    trainer = Trainer(model=model, args=args, data_collator=_collate, callbacks=[Grab()],
                      train_dataset=data, eval_dataset=data)
    try:
        if engine == "fsdp2":
            from .trainer_cases import _force_fsdp2

            _force_fsdp2(trainer)
        if method is not None:
            from easy_context import enable_sequence_parallel

            enable_sequence_parallel(trainer, method, sp_size,
                                     **({} if max_length is None
                                        else {"max_length": True, **max_length}))
            if break_vision:
                state = trainer._easy_context
                shard = type(state).shard
                state.shard = lambda inputs: shard(state, {
                    k: v for k, v in inputs.items()
                    if k not in ("pixel_values", "image_grid_thw", "mm_token_type_ids")})
                trainer._easy_context.check_batch = lambda batch, trainer: None
        if evaluate_only:
            return {"eval_loss": trainer.evaluate()["eval_loss"]}
        trainer.train()
        history = trainer.state.log_history
        return {"loss": history[0]["loss"], "grad_norm": history[0]["grad_norm"],
                "grads": grads, "eval_loss": trainer.evaluate()["eval_loss"],
                "tokens": trainer.state.num_input_tokens_seen,
                "tower_sharded": tower_sharded(trainer.model),
                "max_length_paths": _max_length_paths(model)}
    finally:
        if engine == "deepspeed":  # later models in this process are built without zero.Init
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        _env_for_accelerate()


def _max_length_paths(model) -> list[str] | None:
    """Each decoder layer's max-length path ("fused"/"generic"), None when the mode is off."""
    from easy_context.memory.maxlen import max_length_settings

    state = max_length_settings(model)
    return None if state is None else list(state.paths)


def _engine_args(engine: str) -> dict:
    """TrainingArguments for DeepSpeed ZeRO-3 with every parameter partitioned (the tiny
    tower's would otherwise stay whole, below the persistence threshold, never gathered)."""
    if engine != "deepspeed":
        return {}
    from .trainer_cases import _deepspeed_config

    config = _deepspeed_config(1)
    config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    return {"deepspeed": config}


def _whole_grad(p, engine: str):
    """This parameter's whole gradient before the optimizer: FSDP2's is a sharded DTensor,
    ZeRO-3's partitioned in its optimizer (both gathered here, on every rank)."""
    if engine == "deepspeed":
        from deepspeed.utils import safe_get_full_grad

        g = safe_get_full_grad(p)
        return g.detach().clone() if g is not None else torch.zeros(p.ds_shape)
    if p.grad is None:
        return torch.zeros(tuple(p.shape))
    g = p.grad
    return (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()


def vlm_trainer_error(folder: str, family: str, batch_keys: dict | None = None,
                      engine: str = "ddp", evaluate_only: bool = False) -> str:
    """What one sequence-parallel Trainer step (or evaluate() alone) says for ``family``
    (refusals), the batch given extra keys ``batch_keys``, on ``engine``."""
    batch = vlm_batch(family if family.startswith("qwen") or family == "gemma3" else "llava")
    batch.update(copy.deepcopy(batch_keys or {}))
    batch = {k: v for k, v in batch.items() if v is not None}  # None: the key left out
    try:
        vlm_trainer_step(folder, family, "zigzag_ring_attn", batch=batch, engine=engine,
                         evaluate_only=evaluate_only)
    except ValueError as e:
        return f"ValueError: {e}"
    return "trained"


def _llava_processor():
    """A LLaVA processor for vlm_cases' tiny LLaVA: the ids 3..88 as words, <image> = 90
    (4 tokens: a 4x4 image of 2x2 patches, CLS dropped), CLIP's preprocessing at 4x4."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    vocab = {str(i): i for i in range(3, 89)}
    vocab.update({"<pad>": 0, "<unk>": 1, "<eos>": 2, "<image>": IMAGE})
    words = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>",
                                        eos_token="<eos>", pad_token="<pad>",
                                        extra_special_tokens={"image_token": "<image>"})
    images = CLIPImageProcessor(size={"shortest_edge": 4}, crop_size={"height": 4, "width": 4})
    return LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=2,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token="<image>")


def _sft_dataset():
    """Two conversations as TRL's vision datasets hold them ("images", "text"): row 0 of 46
    tokens, its images across 12, 24 and 36 (zigzag's edges at 2 ranks; 24: contiguous
    shards'), row 1 of 30 (right-padded by the collator), an image across nothing."""
    import datasets
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    words = lambda n: " ".join(str(x) for x in rng.integers(3, 89, n))  # noqa: E731
    image = lambda: Image.fromarray(rng.integers(0, 255, (6, 6, 3), dtype=np.uint8))  # noqa: E731
    rows = [{"images": [image(), image(), image()],
             "text": f"{words(10)} <image> {words(8)} <image> {words(8)} <image> {words(8)}"},
            {"images": [image()], "text": f"{words(5)} <image> {words(21)}"}]
    return datasets.Dataset.from_list(rows)


def vlm_sft_step(folder: str, method: str | None) -> dict:
    """One step of TRL's SFTTrainer on its vision path (DataCollatorForVisionLanguageModeling
    with a LLaVA processor) for the tiny LLaVA; gradients before the optimizer, as
    vlm_trainer_step."""
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    _env_for_accelerate()
    model = tiny_vlm("llava")
    grads: dict = {}

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            for name, p in kwargs["model"].named_parameters():
                grads[name] = (p.grad.detach().clone() if p.grad is not None
                               else torch.zeros_like(p))

    args = SFTConfig(
        output_dir=f"{folder}/sft-vlm-{method}", per_device_train_batch_size=2, max_steps=1,
        learning_rate=0.1, optim="sgd", lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1e9, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        seed=3, disable_tqdm=True, remove_unused_columns=False, bf16=False, max_length=None)
    trainer = SFTTrainer(model=model, args=args, train_dataset=_sft_dataset(),
                         processing_class=_llava_processor(), callbacks=[Grab()])
    try:
        if method is not None:
            from easy_context import enable_sequence_parallel

            enable_sequence_parallel(trainer, method)
        trainer.train()
        history = trainer.state.log_history
        return {"loss": history[0]["loss"], "grad_norm": history[0]["grad_norm"],
                "grads": grads, "collator": type(trainer.data_collator).__name__,
                "metrics": {k: history[0][k] for k in ("entropy", "mean_token_accuracy",
                                                       "num_tokens") if k in history[0]}}
    finally:
        _env_for_accelerate()
