"""The up-front checks of generate's image prompts (generation/vision_prompt.py), in one
process: what it refuses before any collective, and the prompt digest every rank compares."""

import pytest
import torch

from easy_context.generation.vision_prompt import check_vision_prompt, media_digest
from tests.dist.vlm_cases import tiny_vlm
from tests.dist.vlm_generate_cases import image_prompt


def _media(inputs: dict) -> dict:
    return {k: inputs.get(k) for k in ("pixel_values", "image_grid_thw")}


def test_text_prompt_needs_no_vision_step():
    inputs = image_prompt("qwen2_5_vl")
    assert check_vision_prompt(tiny_vlm("qwen2_5_vl"), {"pixel_values": None}, None,
                               inputs["input_ids"], None, 1, False) is None


@pytest.mark.parametrize("copies,sharded,says", [
    (2, False, "num_return_sequences"),
    (1, True, "unsharded copy"),
])
def test_refused(copies, sharded, says):
    inputs = image_prompt("qwen2_5_vl")
    with pytest.raises(ValueError, match=says):
        check_vision_prompt(tiny_vlm("qwen2_5_vl"), _media(inputs), None, inputs["input_ids"],
                            None, copies, sharded)


def test_mm_token_type_ids_must_mark_the_placeholders():
    inputs = image_prompt("qwen2_5_vl")
    model = tiny_vlm("qwen2_5_vl")
    family = check_vision_prompt(model, _media(inputs), inputs["mm_token_type_ids"],
                                 inputs["input_ids"], None, 1, False)
    assert family is not None and family.mrope
    wrong = inputs["mm_token_type_ids"].clone()
    wrong[0, 0] = 1  # a text token marked as an image's
    with pytest.raises(ValueError, match="mm_token_type_ids"):
        check_vision_prompt(model, _media(inputs), wrong, inputs["input_ids"], None, 1, False)


def test_a_text_model_given_pixel_values_is_refused():
    from tests.dist.generate_cases import tiny_model

    inputs = image_prompt("llava")
    with pytest.raises(ValueError, match="no vision tower"):
        check_vision_prompt(tiny_model("llama"), _media(inputs), None, inputs["input_ids"],
                            None, 1, False)


def test_digest_tells_other_images_apart():
    media = _media(image_prompt("qwen2_5_vl"))
    other = dict(media, pixel_values=media["pixel_values"].clone())
    assert media_digest(media) == media_digest(other)
    other["pixel_values"][3, 1] += 1e-3
    assert media_digest(media) != media_digest(other)
    assert media_digest(media) != media_digest(dict(media, image_grid_thw=None))
