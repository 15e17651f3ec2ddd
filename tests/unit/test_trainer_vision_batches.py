"""shard_trainer_batch with images (integrations/trainer_batches.py) on one process: each
rank's shard of a Trainer batch with pixel values, as the Trainer integration cuts it."""

import pytest
import torch

from easy_context.integrations.trainer_batches import shard_trainer_batch
from easy_context.sequence_parallel import unshard_sequence
from tests.dist.trainer_vlm_cases import vlm_batch
from tests.dist.vlm_cases import tiny_vlm


def test_pixel_values_refused_without_a_vision_model():
    """A text model's integration (model=None): pixel_values are a key it does not cut."""
    with pytest.raises(ValueError, match=r"carries \['image_grid_thw', 'mm_token_type_ids', "
                                         r"'pixel_values'\]"):
        shard_trainer_batch(vlm_batch("qwen2_5_vl"), "zigzag_ring_attn", 0, 2)


def test_positions_are_the_models_own_on_the_whole_padded_batch():
    """The batch (46 tokens, padded here to zigzag's multiple of 4: 48) cut in two: the
    shards put back together hold the ids, and for every real token the multimodal
    positions of the model's own get_rope_index with the attention mask."""
    model = tiny_vlm("qwen2_5_vl")
    batch = vlm_batch("qwen2_5_vl")
    batch = {k: v[:, :46] if v.dim() == 2 and v.size(1) == 48 else v for k, v in batch.items()}
    shards = [shard_trainer_batch(batch, "zigzag_ring_attn", r, 2, model=model)
              for r in range(2)]
    assert all(s.position_ids.shape == (3, 2, 24) and s.vision is not None for s in shards)
    assert all(s.length == 46 for s in shards)
    ids = unshard_sequence(torch.cat([s.input_ids for s in shards], 1), "zigzag_ring_attn", 2)
    assert torch.equal(ids[:, :46], batch["input_ids"])
    positions = unshard_sequence(torch.cat([s.position_ids for s in shards], 2),
                                 "zigzag_ring_attn", 2, dim=2)
    own, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                        image_grid_thw=batch["image_grid_thw"],
                                        attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    assert torch.equal(positions[:, :, :46][:, real], own[:, real])
    # the image across zigzag's first edge (row 0, tokens 10-15) is encoded by both ranks
    encoded = [set(s.vision.media[0].encoded) for s in shards]
    assert 1 in encoded[0] and 1 in encoded[1]


def test_left_padding_positions_are_the_models_own():
    """Left padding (a prompt-completion collator before TRL's flush_left) becomes a document
    of its own; the real tokens' multimodal positions still equal get_rope_index's with the
    attention mask."""
    model = tiny_vlm("qwen2_5_vl")
    batch = vlm_batch("qwen2_5_vl")
    mask = batch["attention_mask"]
    order = torch.cat([torch.arange(44, 48), torch.arange(44)])  # row 0: its padding first
    for key in ("input_ids", "attention_mask", "labels", "mm_token_type_ids"):
        batch[key][0] = batch[key][0][order]
    assert not bool(mask[0, 0]) and bool(mask[0, -1])
    shards = [shard_trainer_batch(batch, "ulysses_attn", r, 2, model=model) for r in range(2)]
    positions = torch.cat([s.position_ids for s in shards], 2)  # contiguous shards
    own, _ = model.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"],
                                        image_grid_thw=batch["image_grid_thw"],
                                        attention_mask=batch["attention_mask"])
    real = batch["attention_mask"].bool()
    assert torch.equal(positions[:, real], own[:, real])
    assert shards[0].document_ids is not None  # the padding kept apart


def test_a_text_only_batch_of_a_vision_model():
    """A processor's batch without images (mm_token_type_ids all zero) is cut as text; image
    placeholders without pixel values are refused (the model's own forward refuses them)."""
    model = tiny_vlm("qwen2_5_vl")
    batch = vlm_batch("qwen2_5_vl")
    text = {k: batch[k] for k in ("input_ids", "attention_mask", "labels")}
    text["input_ids"] = text["input_ids"].clamp(max=89)  # no placeholder left (90, 91)
    text["mm_token_type_ids"] = torch.zeros_like(text["input_ids"])
    shard = shard_trainer_batch(text, "zigzag_ring_attn", 0, 2, model=model)
    assert shard.vision is None and shard.position_ids.shape == (2, 24)
    with pytest.raises(ValueError, match="image placeholder tokens but the batch carries no "
                                         "pixel values"):
        shard_trainer_batch({k: v for k, v in batch.items() if k != "pixel_values"},
                            "zigzag_ring_attn", 0, 2, model=model)
