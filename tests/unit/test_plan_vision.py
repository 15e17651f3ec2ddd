"""The planner's vision tower (easy_context/plan/vision.py): its parameters from the vision
config against the real module's, its activations against a measured forward and backward,
and its place in the estimate and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from easy_context.plan.estimate import estimate_memory
from easy_context.plan.shapes import shape_from_config
from easy_context.plan.vision import pixel_width, tower_parameters, vision_from_config
from tests.dist.vlm_cases import tiny_vlm

# the planner's count against transformers' module, relative: the tiny models' norms and
# biases weigh more than a full-size model's (measured: within 1.2% tiny, 0.01% full-size)
TINY_TOL, FULL_TOL = 0.02, 0.001
# planned tower activations against the measured peak of its forward and backward
# (measured: Qwen2.5-VL +4.1%, LLaVA +5.5%, both over: the plan errs on the safe side)
ACT_TOL = 0.10


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "qwen3_5", "llava", "internvl"])
def test_tower_parameters_tiny(family):
    config = tiny_vlm(family).config
    planned, real = vision_from_config(config).num_params(), tower_parameters(config)
    assert real and abs(planned - real) <= TINY_TOL * real, (planned, real)


def _full_size():
    import transformers as tf

    return {
        "Qwen2.5-VL-7B": tf.Qwen2_5_VLConfig(vision_config=dict(
            hidden_size=1280, intermediate_size=3420, depth=32, out_hidden_size=3584,
            num_heads=16)),
        "Qwen3-VL (default config)": tf.Qwen3VLConfig(),
        "LLaVA-1.5 (default config)": tf.LlavaConfig(),
        "InternVL (default config)": tf.InternVLConfig(),
    }


@pytest.mark.parametrize("name", list(_full_size()))
def test_tower_parameters_full_size(name):
    config = _full_size()[name]
    planned, real = vision_from_config(config).num_params(), tower_parameters(config)
    assert real > 1e8 and abs(planned - real) <= FULL_TOL * real, (planned, real)


def _measured_tower_peak(family: str, images: int = 16, side: int = 8) -> tuple[int, int]:
    """(patches, bytes): the peak of the tiny tower's forward and backward on ``images``
    images (fp32), above the model's parameters and gradients (torch's MemTracker: every
    live tensor, the pixel values made inside included)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType

    torch.manual_seed(0)
    model = tiny_vlm(family)
    config = model.config
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        if family.startswith("qwen"):
            grid = torch.tensor([[1, side, side]] * images)
            pixels = torch.randn(images * side * side, pixel_width(config))
            out = model.get_image_features(pixels, grid, return_dict=True)
            patches = images * side * side
        else:
            size, patch = config.vision_config.image_size, config.vision_config.patch_size
            pixels = torch.randn(images, 3, size, size)
            out = model.get_image_features(pixel_values=pixels, return_dict=True)
            patches = images * (size // patch) ** 2
        features = out.pooler_output
        features = torch.cat(list(features)) if isinstance(features, (list, tuple)) else features
        features.pow(2).sum().backward()
    snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    held = snap[_MemRefType.PARAM] + snap[_MemRefType.GRAD] + snap[_MemRefType.BUFFER]
    return patches, snap["Total"] - held


@pytest.mark.parametrize("family", ["qwen2_5_vl", "llava"])
def test_tower_activations_against_measured_peak(family):
    patches, measured = _measured_tower_peak(family)
    vision = vision_from_config(tiny_vlm(family).config)
    tokens = patches // vision.patches_per_token
    planned = vision.activation_bytes(vision.patches(tokens), 4)
    assert measured > 0 and abs(planned - measured) <= ACT_TOL * measured, (planned, measured)


def test_estimate_counts_the_tower():
    config = _full_size()["Qwen2.5-VL-7B"]
    shape, vision = shape_from_config(config, "qwen2.5-vl"), vision_from_config(config)
    text = estimate_memory(shape, 65536, 8, "zigzag_ring_attn", engine="fsdp")
    images = estimate_memory(shape, 65536, 8, "zigzag_ring_attn", engine="fsdp",
                             vision=vision, image_tokens=4096)
    # the tower's states, sharded over the 8 devices like the decoder's (fp32 params)
    assert images.parameters - text.parameters == pytest.approx(
        vision.num_params() * 4 / 8, rel=1e-3)
    assert images.image_tokens == 4096 and images.vision_activations == vision.stored_bytes(
        vision.patches(4096), 2, vision.pixel_width)
    assert images.total > text.total
    # the worst rank holds at most its shard's tokens
    crowded = estimate_memory(shape, 65536, 8, "zigzag_ring_attn", engine="fsdp",
                              vision=vision, image_tokens=10**6)
    assert crowded.image_tokens == 65536 // 8
    assert "vision activations" in images.table() and "vision" not in text.table()
    with pytest.raises(ValueError, match="vision tower"):
        estimate_memory(shape, 65536, 8, "zigzag_ring_attn", image_tokens=16)
    with pytest.raises(ValueError, match="max-length"):
        estimate_memory(shape, 65536, 8, "zigzag_ring_attn", vision=vision, image_tokens=16,
                        mlp_tile=1024)


def test_cli_image_tokens(tmp_path, capsys):
    from easy_context.cli import main

    tiny_vlm("qwen2_5_vl").config.save_pretrained(tmp_path)
    assert main(["plan", "--model", str(tmp_path), "--seq-len", "4096", "--devices", "2",
                 "--image-tokens", "1024", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["estimate"]["image_tokens"] == 1024
    assert data["estimate"]["vision_parameters"] == vision_from_config(
        tiny_vlm("qwen2_5_vl").config).num_params()
    # a built-in text shape has no tower: one line that says what to pass
    assert main(["plan", "--model", "Llama-2-7B", "--seq-len", "4096",
                 "--image-tokens", "16"]) == 2
    assert "vision-language model folder" in capsys.readouterr().err
