"""Vision-language models in transformers' Trainer and TRL's SFTTrainer (its vision collator)
with enable_sequence_parallel, on 2 gloo ranks (and dp 2 x sp 2 on 4), against the same
Trainer step in one process with the model's own forward and loss.

The batch has the keys of TRL's DataCollatorForVisionLanguageModeling (pixel_values, and
image_grid_thw / mm_token_type_ids for Qwen; right padding), images straddling the shard
boundaries. After one step, the logged loss and gradient norm, and evaluate()'s loss (no
logits: no compute_metrics), within TOL (relative), and
every parameter's gradient before the optimizer, the vision tower's included (reduced by DDP
like every replicated parameter), within TOL relative to that tensor's largest entry (fp32;
NaN-safe). Families the methods cannot cut with images are refused with one line.
"""

from __future__ import annotations

import pytest

import torch  # noqa: E402

from .trainer_vlm_cases import (vlm_trainer_anyres, vlm_trainer_error,  # noqa: E402
                                vlm_trainer_step)

TOL = 1e-5


def _errors(sp: dict, ref: dict) -> dict:
    """{what: relative error}: the loss, the grad norm, and the worst gradient. A gradient
    that is zero in exact arithmetic (the vision keys' bias: softmax ignores a shift shared
    by all keys) is measured against 1e-3 of the largest gradient (as vlm_cases.grad_error)."""
    grads = ref["grads"]
    floor = 1e-3 * torch.stack([g.abs().max() for g in grads.values()]).max()
    worst = torch.zeros(())
    assert sorted(sp["grads"]) == sorted(grads)
    for name, g_ref in grads.items():
        g = sp["grads"][name]
        scale = torch.maximum(g_ref.abs().max(), floor).clamp(min=1e-6)
        worst = torch.maximum(worst, (g - g_ref).abs().max() / scale)
    errors = {"loss": abs(sp["loss"] - ref["loss"]) / abs(ref["loss"]),
            "grad_norm": abs(sp["grad_norm"] - ref["grad_norm"]) / abs(ref["grad_norm"]),
            "grads": worst.item()}
    if "eval_loss" in ref:  # after the step: the trained weights' loss, without logits
        errors["eval_loss"] = abs(sp["eval_loss"] - ref["eval_loss"]) / abs(ref["eval_loss"])
    return errors


def _vision_grad(result: dict) -> float:
    return sum(float(g.abs().sum()) for n, g in result["grads"].items()
               if "visual" in n or "vision_tower" in n)


@pytest.fixture(scope="module")
def references(dist1, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("vlm_trainer"))
    return folder, {family: dist1.run(vlm_trainer_step, folder, family, None)[0]
                    for family in ("qwen2_5_vl", "llava", "qwen3_vl", "gemma3", "gemma4")}


@pytest.mark.parametrize("family, method", [
    ("qwen2_5_vl", "zigzag_ring_attn"), ("qwen2_5_vl", "ulysses_attn"),
    ("llava", "zigzag_ring_attn"), ("llava", "ulysses_attn"),
    ("qwen3_vl", "zigzag_ring_attn"),  # deepstack features beside multimodal RoPE
    ("gemma3", "zigzag_ring_attn"),  # images both ways inside (token_type_ids), a window
    ("gemma4", "zigzag_ring_attn"),  # the same on its sliding layers only, patch positions
])
def test_trainer_step_with_images_equals_one_process(references, dist2, family, method):
    folder, refs = references
    ref = refs[family]
    assert torch.isfinite(torch.tensor(ref["loss"])) and _vision_grad(ref) > 0
    for rank, result in enumerate(dist2.run(vlm_trainer_step, folder, family, method)):
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)
        assert _vision_grad(result) > 0


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_trainer_max_length_with_images_equals_one_process(references, dist2, family):
    """max_length=True with an image batch: the decoder's layers tiled (MLP tiles of 5 tokens
    against shards of 48), one query head per chunk, inputs offloaded, the final norm in the
    loss's chunks; the tower as without it. The same step as the plain model's."""
    folder, refs = references
    ref = refs[family]
    settings = {"mlp_tile": 5, "head_chunk": 1, "checkpointing": "offload"}
    for rank, result in enumerate(dist2.run(vlm_trainer_step, folder, family,
                                            "zigzag_ring_attn", max_length=settings)):
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)
        assert _vision_grad(result) > 0 and result["max_length_paths"] == ["fused", "fused"]


def test_trainer_without_the_vision_path_differs(references, dist2):
    """The scratch break that the test above must catch: the images hidden from the loss
    (placeholder tokens embedded as text) give another loss and gradients."""
    folder, refs = references
    result = dist2.run(vlm_trainer_step, folder, "qwen2_5_vl", "zigzag_ring_attn", None, True)[0]
    errors = _errors(result, refs["qwen2_5_vl"])
    assert not all(e <= TOL for e in errors.values()), errors


@pytest.mark.parametrize("family, extra, engine, message", [
    ("gemma3", {"token_type_ids": None}, "ddp", "token_type_ids"),
    ("gemma4", {"mm_token_type_ids": None}, "ddp", "mm_token_type_ids"),
    ("paligemma", None, "ddp", "prefix"),
    ("llava_next", {"image_sizes": torch.tensor([[8, 8]] * 5)}, "ddp", "not the tiles"),
    ("qwen2_5_vl", {"mm_token_type_ids": torch.zeros(2, 48, dtype=torch.long)}, "ddp",
     "mm_token_type_ids"),
    ("qwen2_5_vl", {"position_ids": torch.arange(48).expand(2, 48)}, "ddp", "position_ids"),
])
def test_trainer_images_refused_with_one_line(references, dist2, family, extra, engine,
                                              message):
    folder, _ = references
    engine, *alone = engine.split()
    for said in dist2.run(vlm_trainer_error, folder, family, extra, engine, bool(alone)):
        assert said.startswith("ValueError") and message in said and "\n" not in said, said


@pytest.mark.parametrize("family, engine", [
    ("qwen2_5_vl", "fsdp2"), ("llava", "fsdp2"), ("qwen2_5_vl", "deepspeed"),
    ("llava", "deepspeed"),
])
def test_sharded_tower_with_a_rank_without_images(dist1, dist2, tmp_path, family, engine):
    """FSDP2 (accelerate's wrap: each vision block and decoder layer, and the root) and
    DeepSpeed ZeRO-3 (every parameter partitioned) with images: the batch's images all in the
    first rank's shard (ring_attn), so the second runs the tower on a dummy image; one step
    and evaluate() equal one process."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    from .vlm_sharded_cases import early_batch

    batch = early_batch(family)
    ref = dist1.run(vlm_trainer_step, str(tmp_path), family, None, batch)[0]
    assert _vision_grad(ref) > 0
    for rank, result in enumerate(dist2.run(vlm_trainer_step, str(tmp_path), family,
                                            "ring_attn", batch, False, engine)):
        assert result["tower_sharded"], rank  # the engine did shard it
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)
        assert _vision_grad(result) > 0


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_sharded_tower_with_a_text_batch_beside(dist1, dist2, tmp_path, engine):
    """Two data-parallel groups of one rank, the first's batch with images, the second's text
    only: the second still runs the sharded tower once (text_through_tower), against one
    process accumulating both batches."""
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    from .vlm_sharded_cases import early_batch, text_batch

    batch, text = early_batch("qwen2_5_vl"), text_batch("qwen2_5_vl")
    ref = dist1.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl", None, batch, False, "ddp",
                    None, 2, second=text)[0]
    for rank, result in enumerate(dist2.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl",
                                            "ring_attn", batch, False, engine, 1, 1,
                                            second=text)):
        assert result["tower_sharded"], rank
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)


@pytest.mark.parametrize("method", ["zigzag_ring_attn", "ulysses_attn"])
def test_trl_sft_vision_path_equals_one_process(dist1, dist2, tmp_path, method):
    """TRL's SFTTrainer on a vision dataset (images and text, its own vision collator with
    a LLaVA processor): one step at 2 ranks equals one process, TRL's metrics too."""
    pytest.importorskip("trl")
    from .trainer_vlm_cases import vlm_sft_step

    ref = dist1.run(vlm_sft_step, str(tmp_path), None)[0]
    assert ref["collator"] == "DataCollatorForVisionLanguageModeling", ref["collator"]
    assert _vision_grad(ref) > 0
    for rank, result in enumerate(dist2.run(vlm_sft_step, str(tmp_path), method)):
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)
        # TRL's entropy, mean_token_accuracy and num_tokens, over the whole batch
        assert sorted(result["metrics"]) == ["entropy", "mean_token_accuracy", "num_tokens"]
        for key, value in ref["metrics"].items():
            assert abs(result["metrics"][key] - value) <= TOL * abs(value), (key, result, ref)


def test_two_data_parallel_groups_with_images(dist1, dist4, tmp_path):
    """dp 2 x sp 2 (zigzag), one batch per group, against one process accumulating the two
    batches (other ids and pixels, the images at the same places)."""
    ref = dist1.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl", None, None, False, "ddp",
                    None, 2)[0]
    for rank, result in enumerate(dist4.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl",
                                            "zigzag_ring_attn", None, False, "ddp", 2, 1)):
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)


def test_lora_on_the_decoder_with_images(dist1, dist2, tmp_path):
    """A PeftModel (LoRA on the text decoder's q/v projections, the tower frozen): the
    images reach the base model's loss forward through PEFT's forward."""
    pytest.importorskip("peft")
    options = (None, False, "ddp", None, 1, True)
    ref = dist1.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl", None, *options)[0]
    trained = [n for n, g in ref["grads"].items() if bool(g.abs().sum() > 0)]
    assert trained and all("lora_" in n for n in trained), trained
    for rank, result in enumerate(dist2.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl",
                                            "zigzag_ring_attn", *options)):
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)


def test_gradient_accumulation_with_images(dist1, dist2, tmp_path):
    """Two batches accumulated into one step, at 2 ranks (Ulysses) as in one process."""
    ref = dist1.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl", None, None, False, "ddp",
                    None, 2)[0]
    for rank, result in enumerate(dist2.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl",
                                            "ulysses_attn", None, False, "ddp", None, 2)):
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)


def test_a_video_beside_images(dist1, dist2, tmp_path):
    """Qwen2.5-VL with a video of two frames (pixel_values_videos, video_grid_thw,
    second_per_grid_ts) across the contiguous shards' edge (24), beside images."""
    from .trainer_vlm_cases import vlm_batch

    batch = vlm_batch("qwen2_5_vl", video=True)
    assert int((batch["mm_token_type_ids"] == 2).sum()) == 4
    ref = dist1.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl", None, batch)[0]
    for rank, result in enumerate(dist2.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl",
                                            "ulysses_attn", batch)):
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)


@pytest.mark.parametrize("family", ["llava_next", "mistral3"])
def test_trainer_step_image_sizes_towers(dist1, dist2, tmp_path, family):
    """Towers that take image_sizes (LLaVA-NeXT's tiles, Mistral 3's cropped padded batch):
    the batch's image_sizes are cut with its images; one zigzag step at 2 ranks equals the
    one-process step (loss, grad norm, every gradient, eval loss)."""
    ref = dist1.run(vlm_trainer_anyres, str(tmp_path), family, None)[0]
    assert torch.isfinite(torch.tensor(ref["loss"])) and _vision_grad(ref) > 0
    for rank, result in enumerate(dist2.run(vlm_trainer_anyres, str(tmp_path), family,
                                            "zigzag_ring_attn")):
        errors = _errors(result, ref)
        assert all(e <= TOL for e in errors.values()), (rank, errors)
        assert _vision_grad(result) > 0


def test_sharded_tower_max_length(dist1, dist2, tmp_path):
    """max_length=True under FSDP2 with a sharded tower: a rank without image tokens (it runs
    the tower on a dummy image), and two data-parallel groups of one rank, the second's batch
    text only (text_through_tower: it still runs the tower once, also in max-length mode, or
    the first rank's gathers would wait for it); each equal to one process."""
    from .vlm_sharded_cases import early_batch, text_batch

    settings = {"mlp_tile": 5, "head_chunk": 2, "checkpointing": "full"}
    batch, text = early_batch("qwen2_5_vl"), text_batch("qwen2_5_vl")
    ref = dist1.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl", None, batch)[0]
    ref2 = dist1.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl", None, batch, False, "ddp",
                     None, 2, second=text)[0]
    for want, args, kw in ((ref, ("ring_attn", batch, False, "fsdp2"), {}),
                           (ref2, ("ring_attn", batch, False, "fsdp2", 1, 1), {"second": text})):
        for rank, result in enumerate(dist2.run(vlm_trainer_step, str(tmp_path), "qwen2_5_vl",
                                                *args, max_length=settings, **kw)):
            assert result["tower_sharded"] and result["max_length_paths"], rank
            errors = _errors(result, want)
            assert all(e <= TOL for e in errors.values()), (rank, errors)
