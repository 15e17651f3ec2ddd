"""The vision tower of a vision-language model, for the memory planner.

Read from the model's ``vision_config`` (and the text hidden size its projector maps to):
the tower's parameters (patch embedding, position table, ViT blocks, the merger or
projector: Qwen's merger and Qwen3-VL's deepstack mergers, LLaVA's / InternVL's two-layer
projector) and the activations of encoding one rank's images.

What a rank encodes (integrations/vision.py): the images and video frames whose placeholder
tokens its shard holds, in one tower call, without checkpointing. ``patches_per_token``
turns placeholder tokens into the patches the tower runs on: Qwen merges
spatial_merge_size^2 patches into a token, InternVL's pixel shuffle 1/downsample_ratio^2,
LLaVA one (its CLS token, one per image, is not counted).

Assumed: the tower runs on the same dtype as the decoder (``a`` bytes per element) with an
attention that keeps its output and log-sum-exp (SDPA / flash), as the decoder's methods do.
"""

from __future__ import annotations

from dataclasses import dataclass

# Towers whose blocks are Llama-style (RMSNorm, a gated MLP: gate, up and down projections:
# Qwen2.5-VL's); no config field says so (hidden_act is "silu" for it and for ungated towers
# alike), the others' are ViT blocks (LayerNorm, fc1 and fc2)
LLAMA_STYLE_TOWERS = ("qwen2_5_vl_vision", "qwen2_5_omni_vision_encoder")


@dataclass(frozen=True)
class VisionShape:
    """A ViT tower and its projector, as far as memory depends on it."""

    hidden: int
    """vision_config.hidden_size"""
    layers: int
    """depth / num_hidden_layers"""
    heads: int
    """num_heads / num_attention_heads"""
    intermediate: int
    """intermediate_size of each block's MLP"""
    gated_mlp: bool
    """Llama-style blocks: RMSNorm and gate, up and down projections (Qwen2.5-VL), rather
    than LayerNorm, fc1 and fc2"""
    embedding_params: int
    """patch embedding and learned position table (and class token)"""
    merger_params: int
    """the merger(s) / projector that map patches to the text hidden size"""
    patches_per_token: int
    """patches the tower runs on per placeholder token"""
    mergers: int = 1
    """mergers run on every patch (Qwen3-VL: 1 + its deepstack mergers)"""
    out_hidden: int = 0
    """the features' width (the text hidden size)"""
    merger_width: int = 0
    """per patch, the width of the merger's (projector's) first linear layer's output"""
    layer_scale: bool = False
    """learned per-channel scales on each block's two branches (InternViT)"""
    pixel_width: int = 0
    """values per patch in the pixel rows: channels x temporal patch x patch area"""
    image_patches: int = 0
    """patches of one fixed-size image, which the tower runs with a class token more (CLIP,
    InternViT); 0: images of any grid, no class token (Qwen)"""

    def patches(self, image_tokens: int) -> int:
        """Positions the tower runs on to make ``image_tokens`` placeholder tokens' features:
        patches_per_token each, and a class token per fixed-size image."""
        patches = image_tokens * self.patches_per_token
        if self.image_patches:
            patches += -(-patches // self.image_patches)
        return patches

    def block_params(self) -> int:
        h, i = self.hidden, self.intermediate
        attention = 4 * h * h + 4 * h                  # qkv and output projections, biases
        mlp = (3 * h * i + 2 * i + h) if self.gated_mlp else (2 * h * i + i + h)
        return attention + mlp + 4 * h                 # two norms (weight and bias)

    def num_params(self) -> int:
        return self.embedding_params + self.layers * self.block_params() + self.merger_params

    def saved_per_patch(self, a: int) -> int:
        """Bytes one block saves for backward per patch (as plan.estimate's decoder layer):
        each norm's input and output (RMSNorm also its fp32 upcast: H x (4 + 2a); LayerNorm
        2 x H x a); q, k, v, the attention output and its lse; the MLP's intermediates
        (gated: 4 x I, else 2 x I); layer scales their branches' outputs (2 x H x a)."""
        h = self.hidden
        norms = 2 * h * ((4 + 2 * a) if self.gated_mlp else 2 * a)
        attention = 4 * h * a + self.heads * 4
        mlp = (4 if self.gated_mlp else 2) * self.intermediate * a
        scales = 2 * h * a if self.layer_scale else 0
        return norms + attention + mlp + scales

    def stored_bytes(self, patches: int, a: int, pixel_width: int = 0) -> int:
        """Saved from the tower's forward to its backward for ``patches`` patches: the
        pixel rows (the patch embedding's input) and its output, every block's saved
        tensors, each merger's (its input and norm output, 2 x H x a per patch; its first
        linear layer's output and activation, 2 x merger_width x a) and the features
        (out_hidden per token)."""
        h = self.hidden
        merger = self.mergers * (2 * h * a + 2 * self.merger_width * a)
        features = -(-patches // self.patches_per_token) * self.out_hidden * a
        return patches * (pixel_width * a + h * a + self.layers * self.saved_per_patch(a)
                          + merger) + features

    def backward_bytes(self, patches: int, a: int) -> int:
        """The largest transient of the tower's backward: one block's gradients per patch
        (the residual stream's in and out, and its MLP's or its attention's)."""
        h = self.hidden
        mlp = (2 if self.gated_mlp else 1) * self.intermediate * a
        attention = 4 * h * a
        return patches * (2 * h * a + max(mlp, attention))

    def activation_bytes(self, patches: int, a: int, pixel_width: int | None = None) -> int:
        """The peak of the tower's own forward and backward above its parameters and
        gradients: what it stores, plus its backward's largest transient."""
        width = self.pixel_width if pixel_width is None else pixel_width
        return self.stored_bytes(patches, a, width) + self.backward_bytes(patches, a)

    def largest_unit(self) -> int:
        """Parameters of the largest piece a sharding engine gathers at once: a block, or
        the embedding or the merger(s) (as plan.states counts a decoder layer)."""
        return max(self.block_params(), self.embedding_params, self.merger_params)


def estimate_terms(vision: VisionShape | None, tokens: int, a: int) -> dict:
    """plan.estimate.MemoryEstimate's vision fields for ``tokens`` placeholder tokens
    encoded on this rank ({} without a tower)."""
    if vision is None:
        return {}
    patches = vision.patches(tokens) if tokens else 0
    return {"vision_activations": vision.stored_bytes(patches, a, vision.pixel_width),
            "vision_backward": vision.backward_bytes(patches, a),
            "vision_parameters": vision.num_params(), "image_tokens": tokens}


def _area(size) -> int:
    if isinstance(size, (list, tuple)):
        return int(size[0]) * int(size[1])
    return int(size) ** 2


def pixel_width(config) -> int:
    """Values per patch: channels x temporal patch x patch area (the tower's input row)."""
    vc = config.vision_config
    channels = getattr(vc, "in_channels", None) or getattr(vc, "num_channels", None) or 3
    return int(channels) * int(getattr(vc, "temporal_patch_size", 1) or 1) * _area(vc.patch_size)


def vision_from_config(config) -> VisionShape | None:
    """The VisionShape of a vision-language model's config (None: it has no vision_config).
    A ValueError says which field it lacks."""
    vc = getattr(config, "vision_config", None)
    if vc is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        h, inter = int(vc.hidden_size), int(vc.intermediate_size)
        layers = int(getattr(vc, "depth", None) or vc.num_hidden_layers)
        heads = int(getattr(vc, "num_heads", None) or vc.num_attention_heads)
        patch = _area(vc.patch_size)
        text_hidden = int(text.hidden_size)
    except (AttributeError, TypeError) as e:
        raise ValueError(f"the planner cannot read this vision_config's sizes ({e}); it plans "
                         "ViT towers with hidden_size, intermediate_size, depth or "
                         "num_hidden_layers, heads and patch_size") from e
    merge_side = getattr(vc, "spatial_merge_size", None)
    ratio = getattr(config, "downsample_ratio", None)
    if merge_side:
        per_token = int(merge_side) ** 2
    elif ratio:
        per_token = round(1 / float(ratio) ** 2)
    else:
        per_token = 1
    table = getattr(vc, "num_position_embeddings", None)
    image = getattr(vc, "image_size", None)
    if table:  # Qwen3-VL: a learned table, interpolated to each grid
        positions = int(table) * h
    elif image:  # CLIP / InternViT: one per patch of the fixed image, and a class token
        positions = (_area(image) // patch + 1) * h + h
    else:  # rotary only (Qwen2.5-VL)
        positions = 0
    embedding = pixel_width(config) * h + positions
    wide = h * per_token
    out = getattr(vc, "out_hidden_size", None)
    if out:  # Qwen: norm, Linear(wide, wide), Linear(wide, out) per merger
        mergers = 1 + len(getattr(vc, "deepstack_visual_indexes", None) or ())
        merger = mergers * (wide * wide + wide + wide * int(out) + int(out) + 2 * wide)
        width = h  # Linear(wide, wide) per token: H per patch
    else:  # LLaVA / InternVL: (norm,) Linear(wide, text), Linear(text, text)
        mergers, out = 1, text_hidden
        merger = (wide * text_hidden + text_hidden + text_hidden * text_hidden + text_hidden
                  + (2 * wide if per_token > 1 else 0))
        width = -(-text_hidden // per_token)
    return VisionShape(hidden=h, layers=layers, heads=heads, intermediate=inter,
                       gated_mlp=getattr(vc, "model_type", "") in LLAMA_STYLE_TOWERS,
                       embedding_params=embedding, merger_params=merger,
                       patches_per_token=per_token, mergers=mergers, out_hidden=int(out),
                       merger_width=width, pixel_width=pixel_width(config),
                       layer_scale=bool(getattr(vc, "layer_scale_init_value", None)),
                       image_patches=_area(image) // patch if image and not table else 0)


def tower_parameters(config) -> int | None:
    """The tower's and projector's parameters as transformers builds them (on the meta
    device: no memory), or None where it cannot: what vision_from_config is checked against."""
    import torch
    from transformers import AutoModelForImageTextToText

    from ..utils.decoder import decoder_of

    try:
        with torch.device("meta"):
            model = AutoModelForImageTextToText.from_config(config)
    except Exception:  # noqa: BLE001 - an unknown family: nothing to check against
        return None
    inside = {id(p) for p in decoder_of(model).parameters()}
    inside |= {id(p) for p in model.get_output_embeddings().parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in inside)


def load_vision(name_or_path: str) -> VisionShape:
    """The VisionShape of a local model folder / config.json (read offline, as
    plan.shapes.load_shape reads its text part), or a ValueError saying what to pass."""
    import os

    if not os.path.exists(name_or_path):
        raise ValueError(f"--image-tokens plans a vision tower read from a model's config: "
                         f"{name_or_path!r} is a built-in text shape; pass --model a local "
                         "vision-language model folder or its config.json")
    from transformers import AutoConfig

    path = name_or_path
    if os.path.isfile(path):
        path = os.path.dirname(os.path.abspath(path))
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    vision = vision_from_config(config)
    if vision is None:
        raise ValueError(f"{name_or_path}'s config has no vision_config: --image-tokens is for "
                         "vision-language models")
    return vision
