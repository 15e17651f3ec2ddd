"""A Hugging Face Trainer batch, cut into this rank's sequence-parallel shard exactly.

Exactly means: the loss over the shards of a sequence-parallel group is the loss that one
process computes on the whole batch with transformers' own attention. So the batch keeps
transformers' meaning:

- targets: a causal LM predicts ``labels[t + 1]`` from token t (the model shifts inside its
  loss), or ``shift_labels[t]`` when the collator gives them (accelerate's Ulysses adapter,
  some padding-free collators); -100 is ignored. They are shifted here, on the whole
  sequence, before it is cut: a shard's last token predicts the next shard's first.
- positions: ``position_ids`` when the collator gives them (padding-free and packed batches
  restart them at every document), else 0, 1, 2, ... as the model counts without a cache.
- documents: where positions restart, transformers keeps the documents apart (its packed-
  sequence mask, or flash-attention's varlen path); here they become ``document_ids``.
- padding: ``attention_mask`` zeros. Padding at the end of a row changes nothing a causal
  model computes for the real tokens before it, so it is dropped (its targets are -100
  already: collators set them so). Padding anywhere else (left padding) becomes documents of
  its own, which the real tokens never see, as the mask would have it.

A length that the method cannot cut is padded at the end (pad token, target -100): causal
attention makes that exact too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sequence_parallel import required_multiple, shard_batch

Tensor = torch.Tensor
IGNORE = -100


@dataclass(frozen=True)
class ShardedBatch:
    """This rank's (B, S_local) inputs and targets, and what it was cut from."""

    input_ids: Tensor
    position_ids: Tensor
    target_ids: Tensor
    document_ids: Tensor | None
    length: int  # the batch's sequence length before any padding to the method's multiple
    vision: object = None  # a VisionShard (integrations/vision.py) when the batch has images

    def model_inputs(self) -> dict[str, Tensor]:
        extra = {} if self.document_ids is None else {"document_ids": self.document_ids}
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, **extra}


def targets_of(batch: dict) -> Tensor:
    """(B, S) targets of a batch: ``shift_labels`` as they are, or ``labels`` shifted by one
    with -100 after the last token."""
    if batch.get("shift_labels") is not None:
        return batch["shift_labels"]
    labels = batch.get("labels")
    if labels is None:
        raise ValueError(f"the batch has no 'labels' (keys: {sorted(batch)}); sequence-parallel "
                         "training computes the causal-LM loss from them: use a collator that "
                         "sets them (DataCollatorForLanguageModeling(mlm=False), TRL's)")
    ignore = torch.full_like(labels[:, :1], IGNORE)
    return torch.cat([labels[:, 1:], ignore], dim=1)


def count_targets(batch: dict) -> Tensor:
    """How many targets of ``batch`` count towards the loss (int64 scalar)."""
    return (targets_of(batch) != IGNORE).sum()


# What a batch may carry: what is sharded here, and the flash-attention and Mamba views of
# packed documents that padding-free collators add beside position_ids (recomputed here from
# the positions). Anything else (token_type_ids, image_sizes, ...) would be dropped.
SHARDED_KEYS = frozenset({"input_ids", "labels", "shift_labels", "attention_mask", "position_ids"})
DOCUMENT_KEYS = frozenset({"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
                           "seq_idx"})
# A vision-language batch (TRL's DataCollatorForVisionLanguageModeling, a processor's output):
# what prepare_vision_inputs takes, and mm_token_type_ids, which it recomputes from the ids
# (checked equal: shard_vision_batch).
PIXEL_KEYS = frozenset({"pixel_values", "pixel_values_videos"})
VISION_KEYS = PIXEL_KEYS | {"image_grid_thw", "video_grid_thw", "second_per_grid_ts",
                            "mm_token_type_ids", "token_type_ids", "image_position_ids",
                            "image_sizes"}


def has_images(batch: dict) -> bool:
    """The batch carries pixel values (images or videos)."""
    return any(batch.get(k) is not None for k in PIXEL_KEYS)


def has_vision_keys(batch: dict) -> bool:
    """The batch carries any of VISION_KEYS (a processor's text-only batch may carry
    mm_token_type_ids alone)."""
    return any(batch.get(k) is not None for k in VISION_KEYS)


def check_batch_keys(batch: dict, vision: bool = False) -> None:
    """Refuse a batch with inputs that sequence-parallel training would not pass on.
    ``vision``: the model is a vision-language one that can be cut with images
    (integrations.vision.describe passed), so VISION_KEYS go through shard_vision_batch."""
    allowed = SHARDED_KEYS | (DOCUMENT_KEYS if batch.get("position_ids") is not None else set())
    if vision:
        allowed = allowed | VISION_KEYS
    extra = sorted(k for k, v in batch.items() if k not in allowed and v is not None)
    if extra:
        raise ValueError(
            f"the batch carries {extra}, which sequence-parallel training does not shard (it "
            "passes input_ids, positions, documents and targets only): drop them from the "
            "dataset or collator (for cu_seq_lens_*/seq_idx: keep position_ids as well)")


def _right_padded(mask: Tensor) -> bool:
    """Every row is ones, then zeros (or all ones)."""
    return bool((mask[:, 1:] <= mask[:, :-1]).all())


def document_ids_of(position_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """(B, S) document ids for the whole batch, or None when every row is one sequence whose
    attention needs nothing but causality. A document starts where the position does not
    increase, and, unless all padding is at row ends, where padding starts or stops."""
    starts = position_ids[:, 1:] <= position_ids[:, :-1]
    if attention_mask is not None and not bool(attention_mask.all()):
        if not _right_padded(attention_mask):
            starts = starts | (attention_mask[:, 1:] != attention_mask[:, :-1])
    if not bool(starts.any()):
        return None
    ids = torch.zeros_like(position_ids, dtype=torch.long)
    ids[:, 1:] = starts.long().cumsum(dim=1)
    return ids


def _pad_end(t: Tensor, n: int, value: int | None) -> Tensor:
    """``t`` (B, S) with n columns more: ``value``, or counting on from the last column."""
    if value is None:
        tail = t[:, -1:] + torch.arange(1, n + 1, device=t.device, dtype=t.dtype)
    else:
        tail = torch.full((t.size(0), n), value, device=t.device, dtype=t.dtype)
    return torch.cat([t, tail], dim=1)


def shard_trainer_batch(batch: dict, method: str, sp_rank: int, sp_size: int,
                        ring_degree: int | None = None, pad_token_id: int = 0,
                        pad_to_multiple: bool = True, model=None) -> ShardedBatch:
    """This rank's shard of a Trainer batch (``input_ids``, ``labels`` or ``shift_labels``,
    optional ``attention_mask`` and ``position_ids``), cut in ``method``'s layout. ``model``:
    the (unwrapped) vision-language model, when the batch may carry images (VISION_KEYS):
    then they are cut with it (prepare_vision_inputs) and the shard's ``vision`` is set."""
    if batch.get("input_ids") is None:
        raise ValueError("the batch has no 'input_ids' (inputs_embeds are not supported): "
                         "sequence-parallel training shards token ids")
    images = model is not None and has_images(batch)
    if model is not None and has_vision_keys(batch):
        check_vision_batch(batch, model)
    else:
        check_batch_keys(batch)
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, sequence); got shape {tuple(input_ids.shape)}")
    B, S = input_ids.shape
    targets = targets_of(batch)
    if targets.shape != input_ids.shape:
        raise ValueError(f"labels {tuple(targets.shape)} and input_ids {tuple(input_ids.shape)} "
                         "differ in shape")
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(S, device=input_ids.device).expand(B, S)
    documents = document_ids_of(positions, batch.get("attention_mask"))
    multiple = required_multiple(method, sp_size, ring_degree)
    extra = (-S) % multiple
    if extra:
        if not pad_to_multiple:
            raise ValueError(
                f"a batch of {S} tokens per row cannot be cut into {method}'s {sp_size} shards "
                f"(the length must be a multiple of {multiple}): pad batches to a multiple of "
                f"{multiple} (pad_to_multiple_of={multiple} in the collator or SFTConfig), or "
                "leave pad_to_multiple=True")
        # At the end of every row: the real tokens before them never see them.
        input_ids = _pad_end(input_ids, extra, pad_token_id)
        targets = _pad_end(targets, extra, IGNORE)
        positions = _pad_end(positions, extra, None)
        if documents is not None:  # the pads join each row's last document
            documents = torch.cat([documents, documents[:, -1:].expand(B, extra)], dim=1)
    if images:
        return _shard_vision(batch, model, method, sp_rank, sp_size, ring_degree, input_ids,
                             targets, positions, documents, S)
    parts = {"input_ids": input_ids, "position_ids": positions.contiguous(),
             "target_ids": targets, "document_ids": documents}
    if sp_size > 1:
        parts = shard_batch(parts, method, sp_rank, sp_size, ring_degree)
    return ShardedBatch(parts["input_ids"], parts["position_ids"], parts["target_ids"],
                        parts["document_ids"], S)


def _cut_like(marks: Tensor | None, input_ids: Tensor) -> Tensor | None:
    """Gemma 3's token_type_ids (Gemma 4's mm_token_type_ids) (B, S) padded with text (0) to
    the padded ids' length."""
    if marks is None or marks.size(1) == input_ids.size(1):
        return marks
    return torch.cat([marks, marks.new_zeros(marks.size(0), input_ids.size(1) - marks.size(1))],
                     dim=1)


def _shard_vision(batch: dict, model, method: str, sp_rank: int, sp_size: int,
                  ring_degree: int | None, input_ids: Tensor, targets: Tensor, positions: Tensor,
                  documents: Tensor | None, length: int) -> ShardedBatch:
    """A batch with images, padded to the method's multiple: cut by prepare_vision_inputs on
    the whole (B, S) ids, so that positions (multimodal RoPE: the model's get_rope_index, per
    document) and which images each rank encodes come from the whole sequence."""
    from .vision import describe, prepare_vision_inputs

    # multimodal RoPE: from get_rope_index, restarting in each document (left padding);
    # else transformers' own: 0..S-1, or the collator's
    given = None if describe(model).mrope else positions
    local = prepare_vision_inputs(
        model, method, input_ids, targets, sp_rank if sp_size > 1 else 0, sp_size,
        pixel_values=batch.get("pixel_values"), image_grid_thw=batch.get("image_grid_thw"),
        pixel_values_videos=batch.get("pixel_values_videos"),
        video_grid_thw=batch.get("video_grid_thw"),
        second_per_grid_ts=batch.get("second_per_grid_ts"), document_ids=documents,
        image_sizes=batch.get("image_sizes"),
        position_ids=given, ring_degree=ring_degree,
        token_type_ids=_cut_like(batch.get("token_type_ids"), input_ids),
        mm_token_type_ids=_cut_like(batch.get("mm_token_type_ids"), input_ids),
        image_position_ids=batch.get("image_position_ids"))
    return ShardedBatch(local["local_input_ids"], local["local_position_ids"],
                        local["local_target_ids"], local["local_document_ids"], length,
                        local["vision"])


def check_vision_batch(batch: dict, model) -> None:
    """Refuse a batch with images that ``model`` cannot be trained on exactly here: what
    integrations.vision.describe refuses (PaliGemma), image_sizes that do not
    match the pixel values (towers that take them), keys that
    are not cut, position_ids beside multimodal RoPE, mm_token_type_ids that disagree with
    the placeholder ids. Pure (no collectives): every rank refuses together."""
    from .vision import describe

    family = describe(model)
    check_batch_keys(batch, vision=True)
    if family.image_sizes and batch.get("pixel_values") is not None:
        from .vision import _check_image_sizes

        # LLaVA-NeXT / OneVision tiles, Mistral 3 crops: the sizes must match the pixels
        _check_image_sizes(model, batch["pixel_values"], batch.get("image_sizes"))
    if not has_images(batch):
        # text only: the placeholders would be embedded as text, where the model's own
        # forward refuses them
        held = [m for m, token in family.token_ids.items()
                if bool((batch["input_ids"] == token).any())]
        if held:
            raise ValueError(f"input_ids hold {' and '.join(held)} placeholder tokens but the "
                             "batch carries no pixel values for them; give the collator the "
                             "images, or drop the placeholders")
    if family.mrope and batch.get("position_ids") is not None:
        raise ValueError("the batch carries position_ids for a model whose positions are "
                         "multimodal (get_rope_index on the whole sequence): drop them from "
                         "the collator (packing is not supported with images here)")
    _check_mm_token_types(batch, family)
    marks = family.spans_from
    if family.image_spans and has_images(batch) and batch.get(marks) is None:
        raise ValueError("the batch carries images for a model whose image tokens attend both "
                         f"ways where {marks} marks them (Gemma 3, Gemma 4), and no "
                         f"{marks}: keep the processor's {marks} in the batch")


def _check_mm_token_types(batch: dict, family) -> None:
    """Qwen processors' ``mm_token_type_ids`` (1 image, 2 video) must say what the
    placeholder ids say: prepare_vision_inputs recomputes them from the ids."""
    given = batch.get("mm_token_type_ids")
    if given is None:
        return
    ids = batch["input_ids"]
    expected = torch.zeros_like(ids)
    for code, modality in enumerate(("image", "video"), start=1):
        if modality in family.token_ids:
            expected[ids == family.token_ids[modality]] = code
    if given.shape != ids.shape or not bool((given.to(expected.dtype) == expected).all()):
        raise ValueError("the batch's mm_token_type_ids do not mark exactly the image and "
                         "video placeholder tokens of input_ids, from which sequence-parallel "
                         "training computes positions; fix the collator's")
