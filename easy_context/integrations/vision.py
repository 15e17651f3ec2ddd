"""Vision-language models under sequence parallelism: a vision tower beside the decoder.

A vision-language model (Qwen2.5-VL, Qwen3-VL, LLaVA-style: a vision tower and a projector
feeding a plain decoder) turns each image (or video) into a run of placeholder tokens'
embeddings. Under sequence parallelism each rank holds a shard of the token sequence, so:

- **Positions** come from the whole sequence: multimodal RoPE's (3, B, L) position ids are
  the model's own ``get_rope_index`` on the whole step (integer work, on every rank, per
  packed conversation), then cut in the method's layout like the tokens.
- **Images are encoded where their tokens are**: each rank runs the vision tower on the
  images, and the video frames (a Qwen tower attends within each temporal grid step), whose
  placeholder tokens overlap its shard, and nothing else; an image or frame that straddles a
  shard boundary is encoded by every rank that holds part of it (the cost: that item's tower
  work once more per extra rank). Each rank scatters only its own rows of the
  features into its own shard's embeddings, so no rank builds the whole sequence's
  embeddings.
- **Gradients**: each rank's vision-tower gradient is its tokens' share; summed over the
  sequence-parallel group (as every replicated parameter's gradient is) it is the
  single-process gradient, a straddling image included (its rows are disjoint per rank).

What a family needs is read from the model (a ``VisionFamily``): the placeholder token ids,
whether the tower takes grids (``image_grid_thw``: Qwen), whether positions are multimodal
(``get_rope_index``), whether the decoder takes deepstack features (Qwen3-VL: the tower's
intermediate features added to the image tokens' hidden states in the first layers, cut here
the same way as the embeddings).
- **Bidirectional images** (Gemma 3: ``token_type_ids``): each image's tokens attend to each
  other both ways, causal elsewhere. The spans (per batch row, whole-sequence (first, stop)
  of each run of image tokens, as the model's ``get_block_sequence_ids_for_mask`` groups
  them) are computed on the whole step before it is cut, like the positions, and reach
  every attention call of the decoder as ``image_spans`` (attention/documents.py plans them:
  no mask tensor). Models whose ``token_type_ids`` mean another mask (PaliGemma's
  bidirectional prefix) stay refused with images.
- **Images of any size** (``image_sizes``): LLaVA-NeXT's and OneVision's tiles, whose token
  count per image is the model's own ``pack_image_features`` on stand-in features
  (``anyres_tokens``), and Mistral 3's padded batch that its tower crops (``cropped_tokens``:
  merged patches); a rank's images go through the model's ``get_image_features`` with their
  sizes, in the rank's one tower call (``_encode``; a sharded tower's dummy image with
  ``dummy_image_sizes``), and the features it gives are checked against the counts.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from ..attention.documents import document_ids_from_positions, is_packed
from ..sequence_parallel import shard_sequence
from ..utils.decoder import decoder_of

Tensor = torch.Tensor

MODALITIES = ("image", "video")

IMAGE_SPANS_KWARG = "image_spans"
"""The keyword argument under which a vision-language step hands its image spans (per batch
row, whole-sequence (first, stop) of each image whose tokens attend to each other both ways:
Gemma 3, Gemma 4) through the decoder to every attention call, which applies them where the
model does (integrations/hf.py ``layer_image_spans``: Gemma 4's sliding layers only)."""


@dataclass(frozen=True)
class VisionFamily:
    """What sequence parallelism needs to know of a vision-language model, read from it."""

    token_ids: dict[str, int]  # modality -> its placeholder token id
    grids: bool        # the tower takes (T, H, W) grids per image (Qwen); else fixed-size images
    merge: int         # patches merged into one token (Qwen's spatial_merge_size ** 2)
    mrope: bool        # positions are (3, B, L) from the base model's get_rope_index
    deepstack: bool    # the decoder takes deepstack_visual_embeds (Qwen3-VL)
    image_spans: bool = False  # image tokens attend to each other both ways (Gemma 3, 4)
    spans_from: str = "token_type_ids"  # the marks they come from (Gemma 4: mm_token_type_ids)
    patch_positions: bool = False  # the tower takes padded patch rows and their (x, y)
    # positions per image (Gemma 4: image_position_ids), one image per row
    image_sizes: bool = False  # the tower takes image_sizes: tiles (LLaVA-NeXT, OneVision)
    # packed by pack_image_features, or a padded batch it crops (Mistral 3)


def is_vision_language(model: nn.Module) -> bool:
    """Whether ``model`` has a vision tower feeding its decoder (``get_image_features``)."""
    return callable(getattr(model, "get_image_features", None))


def _base(model: nn.Module) -> nn.Module:
    return getattr(model, "base_model", model)


def describe(model: nn.Module) -> VisionFamily:
    """The ``VisionFamily`` of ``model``, or a ValueError saying why it cannot run
    sequence-parallel with images."""
    name = type(model).__name__
    if not is_vision_language(model):
        raise ValueError(f"{name} has no vision tower (get_image_features)")
    config = model.config
    image_spans = "token_type_ids" in inspect.signature(model.forward).parameters
    if image_spans and not _groups_images(model):
        # PaliGemma-style models: token_type_ids mark a bidirectional prefix (image and
        # prompt text), not image spans; the kernels take causal masks, documents and spans
        raise ValueError(f"{name} lets its prefix (token_type_ids) attend bidirectionally, "
                         "which the sequence-parallel kernels do not take; train it "
                         "sequence-parallel on text only (no pixel_values), or without "
                         "sequence parallelism")
    text = getattr(config, "text_config", None) or config
    bidirectional = getattr(text, "use_bidirectional_attention", None)
    if bidirectional == "all":
        raise ValueError(f"{name} attends bidirectionally everywhere "
                         "(use_bidirectional_attention='all'): not a causal language model")
    spans_from = "token_type_ids"
    if bidirectional == "vision":
        # Gemma 4: image and video tokens (mm_token_type_ids 1, 2) attend both ways inside
        # each run, on its sliding layers only (hf.layer_image_spans routes them per layer)
        image_spans, spans_from = True, "mm_token_type_ids"
    token_ids = {}
    for modality in MODALITIES:
        value = getattr(config, f"{modality}_token_id", None)
        if value is None:
            value = getattr(config, f"{modality}_token_index", None)
        if value is not None:
            token_ids[modality] = int(value)
    if "image" not in token_ids:
        raise ValueError(f"{name}'s config names no image_token_id")
    params = inspect.signature(model.get_image_features).parameters
    grids = "image_grid_thw" in params
    patch_positions = "image_position_ids" in params
    required = [n for n, p in params.items() if p.default is inspect.Parameter.empty
                and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and n != "pixel_values"]
    any_resolution = required == ["image_sizes"] and (_packs_tiles(model)
                                                     or _crops_images(model))
    if required and not any_resolution:
        # a tower that needs more than image_sizes, or image_sizes for neither tiles packed
        # by the model's pack_image_features nor a padded batch that the tower crops
        raise ValueError(f"{name}'s vision tower needs {', '.join(required)} (images tiled "
                         "at any resolution), which sequence parallelism does not cut per "
                         "image yet; train it with images of one fixed size, or without "
                         "sequence parallelism")
    vision_config = getattr(config, "vision_config", None)
    merge = int(getattr(vision_config, "spatial_merge_size", 1) or 1) ** 2 if grids else 1
    mrope = callable(getattr(_base(model), "get_rope_index", None))
    if mrope and not grids:
        raise ValueError(f"{name} computes multimodal positions without image grids; "
                         "sequence parallelism does not know how to cut them")
    deepstack = "deepstack_visual_embeds" in inspect.signature(
        decoder_of(model).forward).parameters
    if not grids:
        token_ids.pop("video", None)  # fixed-size towers here take images only
    return VisionFamily(token_ids, grids, merge, mrope, deepstack, image_spans, spans_from,
                        patch_positions, any_resolution)


def _module_function(model: nn.Module, name: str):
    """``name`` from the modeling module of ``model``'s class (or a base class's), or None."""
    for cls in type(model).__mro__:
        found = getattr(sys.modules.get(cls.__module__), name, None)
        if callable(found):
            return found
    return None


def _tiler(model: nn.Module) -> nn.Module | None:
    """The module whose ``pack_image_features`` unpads and packs each image's tiles (LLaVA-NeXT
    and OneVision's base model), or None."""
    for module in (getattr(model, "model", None), model):
        if module is not None and callable(getattr(module, "pack_image_features", None)):
            return module
    return None


def _packs_tiles(model: nn.Module) -> bool:
    """Whether the tower tiles each image by its size and packs the tiles' features with the
    model's own ``pack_image_features`` (LLaVA-NeXT, LLaVA-OneVision): the tokens per image
    can then be read from that code (``anyres_tokens``)."""
    return (_tiler(model) is not None
            and _module_function(model, "image_size_to_num_patches") is not None)


def _vision_tower(model: nn.Module) -> nn.Module | None:
    """The model's ``vision_tower`` (on it or on its base model), or None."""
    for module in (model, getattr(model, "model", None)):
        tower = getattr(module, "vision_tower", None)
        if isinstance(tower, nn.Module):
            return tower
    return None


def _crops_images(model: nn.Module) -> bool:
    """Whether the tower takes images of any size padded into one (N, C, H, W) batch and crops
    each to its ``image_sizes`` itself, each attending within itself (Mistral 3's Pixtral),
    with a patch merger of ``spatial_merge_size``: one image per row, its tokens its merged
    patches."""
    tower = _vision_tower(model)
    return (tower is not None and "image_sizes" in inspect.signature(tower.forward).parameters
            and isinstance(getattr(tower, "patch_size", None), int)
            and isinstance(getattr(model.config, "spatial_merge_size", None), int))


def cropped_tokens(model: nn.Module, image_sizes: Tensor) -> list[int]:
    """Placeholder tokens of each image of (N, 2) ``image_sizes`` for a cropping tower
    (Mistral 3): its merged patches, (height // (patch * merge)) * (width // (patch * merge)),
    as the model's ``get_image_features`` splits its features (checked when encoded:
    ``_features``)."""
    step = _vision_tower(model).patch_size * model.config.spatial_merge_size
    return (image_sizes.to("cpu", torch.long) // step).prod(dim=-1).tolist()


def anyres_tiles(model: nn.Module, image_sizes: Tensor) -> list[int]:
    """Tiles (rows of pixel values) of each image of (N, 2) ``image_sizes`` (height, width),
    as the model's own ``get_image_features`` counts them (a base tile and the grid's)."""
    config = model.config
    count = _module_function(model, "image_size_to_num_patches")
    return [int(count(image_size=size, grid_pinpoints=config.image_grid_pinpoints,
                      patch_size=config.vision_config.image_size)) for size in image_sizes]


def anyres_tokens(model: nn.Module, image_sizes: Tensor) -> list[int]:
    """Placeholder tokens of each image of (N, 2) ``image_sizes``: the model's own
    ``pack_image_features`` (unpadding, newline tokens, OneVision's downscaling) run on
    stand-in features of width 1, so the count is the model's, for any of its versions."""
    tiler, config = _tiler(model), model.config
    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    strategy = getattr(config, "vision_feature_select_strategy", "default")
    # rows per tile out of the tower: its patches, a CLIP tower's class row, less the first
    # row under the "default" strategy (as get_image_features selects them)
    per_tile = side * side + int(_has_cls(model)) - int(strategy == "default")
    sizes = image_sizes.to("cpu")
    stand_ins = [torch.zeros(n, per_tile, 1) for n in anyres_tiles(model, sizes)]
    params = inspect.signature(tiler.pack_image_features).parameters
    kw = {}
    if "vision_feature_select_strategy" in params:
        kw["vision_feature_select_strategy"] = strategy
    if "vision_aspect_ratio" in params:
        kw["vision_aspect_ratio"] = getattr(config, "vision_aspect_ratio", "anyres_max_9")
    newline = torch.zeros(1) if getattr(tiler, "image_newline", None) is not None else None
    with torch.no_grad():
        _, lengths = tiler.pack_image_features(stand_ins, sizes, image_newline=newline, **kw)
    return [int(n) for n in lengths]


def _has_cls(model: nn.Module) -> bool:
    """Whether the vision tower's embeddings prepend a class token (CLIP), whose row the
    "default" feature strategy drops."""
    tower = _vision_tower(model)
    embeddings = getattr(getattr(tower, "vision_model", tower), "embeddings", None)
    return getattr(embeddings, "class_embedding", None) is not None


def _groups_images(model: nn.Module) -> bool:
    """Whether the model's modeling module groups image tokens into bidirectional blocks
    (transformers' ``get_block_sequence_ids_for_mask``: Gemma 3) rather than a prefix."""
    for cls in type(model).__mro__:
        module = sys.modules.get(cls.__module__)
        if callable(getattr(module, "get_block_sequence_ids_for_mask", None)):
            return True
    return False


def image_spans_of(image_tokens: Tensor) -> tuple[tuple[tuple[int, int], ...], ...]:
    """(B, L) bool of the whole step's image tokens (token_type_ids == 1) -> per row, the
    (first, stop) of each run: one bidirectional block each, as transformers groups them
    (consecutive image tokens are one block). Documents are kept apart by the kernels."""
    out = []
    for row in image_tokens.to("cpu", torch.bool).tolist():
        spans, start = [], None
        for i, image in enumerate(row + [False]):
            if image and start is None:
                start = i
            elif not image and start is not None:
                spans.append((start, i))
                start = None
        out.append(tuple(spans))
    return tuple(out)


@dataclass
class LocalMedia:
    """One modality's share of a step on this rank: the images (or videos) it encodes and
    where their features go in its shard."""

    modality: str
    pixel_values: Tensor       # the rows of pixel values of the encoded images only
    grid_thw: Tensor | None    # (n_encoded, 3) their grids (families with grids)
    token_mask: Tensor         # (B, S_local) bool: this rank's placeholder tokens
    rows: Tensor               # (n_local_tokens,) feature row of each, in token_mask order
    encoded: tuple[int, ...]   # global indices of the encoded items (images, video frames)
    position_ids: Tensor | None = None  # (n_encoded, P, 2) their patch positions (Gemma 4)
    image_sizes: Tensor | None = None  # (n_encoded, 2) their sizes (any-resolution towers)


@dataclass
class VisionShard:
    """Everything of a step's images one rank needs (``prepare_vision_inputs``)."""

    media: list[LocalMedia] = field(default_factory=list)
    image_spans: tuple = ()
    """Per batch row, whole-sequence (first, stop) of each bidirectional image (Gemma 3);
    () for causal models. Handed to every attention call of the decoder."""


def _tokens_per_item(family: VisionFamily, grid: Tensor | None, count: int, total: int,
                     modality: str) -> list[int]:
    """Placeholder tokens per image: from its grid, or the total split evenly (fixed-size
    towers give every image as many tokens)."""
    if grid is not None:
        return (grid.prod(-1) // family.merge).tolist()
    if count == 0 or total % count:
        raise ValueError(f"{total} {modality} tokens do not split evenly over {count} "
                         f"{modality}s")
    return [total // count] * count


def _patch_tokens(model: nn.Module, pixel_values: Tensor, positions: Tensor | None
                  ) -> list[int]:
    """Soft tokens per image of a tower that takes padded patch rows (Gemma 4): its real
    patches (positions not (-1, -1)) over the pooling kernel's k*k, as the model splits them."""
    if positions is None:
        raise ValueError(f"{type(model).__name__}'s vision tower takes each image's patch "
                         "positions: pass image_position_ids (its processor gives them)")
    if pixel_values.dim() != 3 or positions.shape != (*pixel_values.shape[:2], 2):
        raise ValueError(f"pixel values {tuple(pixel_values.shape)} and image_position_ids "
                         f"{tuple(positions.shape)} must be (N, P, C) and (N, P, 2): one "
                         "image per row")
    kernel = int(model.config.vision_config.pooling_kernel_size) ** 2
    k_squared = int((positions.size(1) // (pixel_values.size(1) // kernel)) ** 0.5) ** 2
    return ((positions != -1).all(-1).sum(-1) // k_squared).tolist()


def _pixel_rows(pixel_values: Tensor, grid: Tensor | None) -> list[int]:
    """Rows of ``pixel_values`` per image: its patches (grids), or one image per row."""
    return grid.prod(-1).tolist() if grid is not None else [1] * pixel_values.size(0)


def _positions(model: nn.Module, family: VisionFamily, input_ids: Tensor,
               document_ids: Tensor | None, grids: dict[str, Tensor | None],
               position_ids: Tensor | None, second_per_grid_ts: Tensor | None = None) -> Tensor:
    """Whole-sequence position ids: (3, B, L) from ``get_rope_index`` per packed conversation
    (each starts at 0, with its own images' grids), or the given / 0..L-1 (B, L) ones."""
    if not family.mrope:
        if position_ids is not None:
            return position_ids.expand_as(input_ids)
        if document_ids is None:
            return torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
        # each packed conversation from 0, as when it runs alone
        starts = torch.ones_like(document_ids, dtype=torch.bool)
        starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
        index = torch.arange(input_ids.size(1), device=input_ids.device).expand_as(input_ids)
        first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
        return index - first
    if position_ids is not None:
        raise ValueError("position_ids are computed from the whole sequence by the model's own "
                         "get_rope_index (multimodal RoPE); pass document_ids for packed "
                         "conversations instead of position_ids")
    base = _base(model)
    types = torch.zeros_like(input_ids, dtype=torch.int)
    for code, modality in enumerate(MODALITIES, start=1):
        if modality in family.token_ids:
            types[input_ids == family.token_ids[modality]] = code
    out = torch.zeros(3, *input_ids.shape, dtype=torch.long, device=input_ids.device)
    seen = {m: 0 for m in MODALITIES}  # images consumed so far, in sequence order
    for b in range(input_ids.size(0)):
        docs = document_ids[b] if document_ids is not None else torch.zeros_like(input_ids[b])
        change = torch.nonzero(docs[1:] != docs[:-1]).flatten().tolist()
        bounds = [0] + [c + 1 for c in change] + [input_ids.size(1)]
        for start, stop in zip(bounds, bounds[1:]):
            ids, kinds = input_ids[b:b + 1, start:stop], types[b:b + 1, start:stop]
            kw = {}
            for code, modality in enumerate(MODALITIES, start=1):
                grid = grids.get(modality)
                if grid is None:
                    continue
                # this conversation's items: as many as its placeholder tokens take (a video
                # may be several runs, one per frame, between timestamps: Qwen3-VL)
                want, first = int((kinds == code).sum()), seen[modality]
                sizes = (grid.prod(-1) // family.merge).tolist()
                while want > 0 and seen[modality] < len(sizes):
                    want -= sizes[seen[modality]]
                    seen[modality] += 1
                if want != 0:
                    raise ValueError(f"the {modality} tokens of a packed conversation do not "
                                     f"match whole {modality}s of {modality}_grid_thw")
                if seen[modality] > first:
                    kw[f"{modality}_grid_thw"] = grid[first:seen[modality]]
                    if modality == "video" and second_per_grid_ts is not None:
                        kw["second_per_grid_ts"] = second_per_grid_ts[first:seen[modality]]
            if kw:
                pos, _ = base.get_rope_index(ids, mm_token_type_ids=kinds, **kw)
            else:
                pos = torch.arange(stop - start, device=ids.device).view(1, 1, -1).expand(3, 1, -1)
            out[:, b, start:stop] = pos[:, 0]
    return out


def rope_positions(model: nn.Module, input_ids: Tensor, *,
                   image_grid_thw: Tensor | None = None, video_grid_thw: Tensor | None = None,
                   second_per_grid_ts: Tensor | None = None) -> Tensor:
    """The whole (B, L) sequence's position ids as the model numbers them: (3, B, L) from
    its own ``get_rope_index`` (multimodal RoPE; each row's items in order), else (B, L)
    0..L-1. What ``prepare_vision_inputs`` cuts; generation also reads each row's largest
    position from it (the next token's is that + 1: transformers' ``rope_deltas``)."""
    return _positions(model, describe(model), input_ids, None,
                      {"image": image_grid_thw, "video": video_grid_thw}, None,
                      second_per_grid_ts)


def prepare_vision_inputs(model: nn.Module, method: str, input_ids: Tensor, target_ids: Tensor,
                          rank: int, world_size: int, *, pixel_values: Tensor | None = None,
                          image_grid_thw: Tensor | None = None,
                          pixel_values_videos: Tensor | None = None,
                          video_grid_thw: Tensor | None = None,
                          document_ids: Tensor | None = None,
                          position_ids: Tensor | None = None,
                          second_per_grid_ts: Tensor | None = None,
                          ring_degree: int | None = None,
                          token_type_ids: Tensor | None = None,
                          mm_token_type_ids: Tensor | None = None,
                          image_position_ids: Tensor | None = None,
                          image_sizes: Tensor | None = None) -> dict:
    """This rank's shard of a vision-language step, in ``method``'s layout. Pure: no
    collectives; every rank holds the whole step's ids and pixel values and computes its own.

    input_ids, target_ids (shifted, -100 ignored), document_ids (packed conversations, one id
    per conversation; for models without multimodal RoPE, position_ids that restart at each
    conversation say the same): (B, L) of the whole step; pixel values and grids as the model's
    processor gives them (``second_per_grid_ts``: Qwen2.5-VL's seconds per video grid step;
    ``token_type_ids``: Gemma 3's image-token marks, 1 on image tokens, required with its
    images: each run of marked tokens attends both ways, as in the model's own forward;
    ``mm_token_type_ids``: Gemma 4's, 1 on image and 2 on video tokens, the same on its
    sliding layers; ``image_position_ids``: Gemma 4's (N, P, 2) patch positions;
    ``image_sizes``: (N, 2) each image's (height, width), required with the images of a
    tower that takes them: LLaVA-NeXT's and OneVision's pixel values are then (N, tiles, C,
    H, W) padded per image, or the images' tiles concatenated, (sum of tiles, C, H, W);
    Mistral 3's (N, C, H, W), each image padded to the largest).
    Returns ``local_input_ids``, ``local_position_ids`` ((3, B, S) for multimodal RoPE, else
    (B, S)), ``local_target_ids``, ``local_document_ids`` (None when not packed) and
    ``vision`` (a VisionShard for ``causal_lm_loss(..., vision=)``).
    """
    family = describe(model)
    values = {"image": pixel_values, "video": pixel_values_videos}
    grids = {"image": image_grid_thw, "video": video_grid_thw}
    for modality in MODALITIES:
        if values[modality] is not None and modality not in family.token_ids:
            raise ValueError(f"{type(model).__name__} takes no {modality}s")
        if family.grids and (values[modality] is None) != (grids[modality] is None):
            raise ValueError(f"pass {modality} pixel values together with their "
                             f"{modality}_grid_thw")
    if image_sizes is not None and not family.image_sizes:
        raise ValueError(f"{type(model).__name__}'s tower takes no image_sizes (its images "
                         "are not tiled by size): leave them out")
    if document_ids is None and position_ids is not None and not family.mrope:
        # packed by restarting positions (padding-free collators), as prepare_seq_parallel_inputs
        position_ids = position_ids.expand_as(input_ids)
        if is_packed(position_ids):
            document_ids = document_ids_from_positions(position_ids)
    positions = _positions(model, family, input_ids, document_ids, grids, position_ids,
                           second_per_grid_ts)
    index = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
    local_index = shard_sequence(index, method, rank, world_size, ring_degree=ring_degree)[0]
    cut = lambda t, dim=1: shard_sequence(t, method, rank, world_size, dim,  # noqa: E731
                                          ring_degree=ring_degree)
    local_ids = cut(input_ids)
    shard = VisionShard()
    if family.image_spans and pixel_values is not None:
        types = token_type_ids if family.spans_from == "token_type_ids" else mm_token_type_ids
        if types is None:
            # the model's own forward makes image tokens bidirectional only where they are
            # marked: without marks it attends causally; so say which is meant
            raise ValueError(f"{type(model).__name__}'s image tokens attend to each other "
                             f"both ways where {family.spans_from} marks them (its processor "
                             f"gives them): pass {family.spans_from} (1 on image tokens)")
        # Gemma 4 groups image (1) and video (2) tokens alike (get_block_sequence_ids_for_mask)
        marks = (types == 1) if family.spans_from == "token_type_ids" else \
            (types == 1) | (types == 2)
        if marks.shape != input_ids.shape:
            raise ValueError(f"{family.spans_from} {tuple(marks.shape)} must be shaped like "
                             f"input_ids {tuple(input_ids.shape)}")
        shard.image_spans = image_spans_of(marks)
    for modality, token_id in family.token_ids.items():
        mask = input_ids == token_id                     # (B, L) the whole step's placeholders
        values_m, grid = values[modality], grids[modality]
        total = int(mask.sum())
        if values_m is None:
            if total:
                raise ValueError(f"input_ids hold {total} {modality} tokens and no "
                                 f"{modality} pixel values came")
            continue
        if grid is not None and family.grids:
            # Qwen's towers attend within each temporal grid step (cu_seqlens per frame), so
            # a video of T steps encodes as T one-step items, feature for feature: a rank
            # encodes only the frames its tokens hold, never the whole video
            grid = grid.repeat_interleave(grid[:, 0], dim=0)
            grid[:, 0] = 1
        patched = family.patch_positions and modality == "image"
        sizes = None
        if family.image_sizes and modality == "image":
            sizes = _check_image_sizes(model, values_m, image_sizes)
        if grid is None and sizes is None and values_m.dim() != 4 and not patched:
            raise ValueError(f"{type(model).__name__}'s pixel values are "
                             f"{tuple(values_m.shape)}; sequence parallelism takes one image "
                             "(or tile) per row, (N, C, H, W)")
        count = grid.size(0) if grid is not None else values_m.size(0)
        if sizes is not None:  # the model's own count per image (tiles, unpadding, newlines)
            count = sizes.size(0)
            per_item = _sized_tokens(model, sizes)
        elif patched:
            per_item = _patch_tokens(model, values_m, image_position_ids)
        else:
            per_item = _tokens_per_item(family, grid, count, total, modality)
        if sum(per_item) != total:
            raise ValueError(f"{modality} tokens ({total}) and features "
                             f"({sum(per_item)}) do not match")
        # feature row of every placeholder, in the model's order (row-major over (B, L))
        row = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
        row[mask] = torch.arange(total, device=mask.device)
        local_mask = mask[:, local_index]                # (B, S_local)
        local_rows = row[:, local_index][local_mask]     # global feature rows held here
        item_start = torch.tensor([0] + per_item, device=mask.device).cumsum(0)
        item_of = torch.searchsorted(item_start[1:], local_rows, right=True)
        encoded = sorted(set(item_of.tolist()))
        # rows in the features of the encoded items only (concatenated in encoded order)
        offsets = torch.zeros(count, dtype=torch.long, device=mask.device)
        run = 0
        for i in encoded:
            offsets[i] = run - item_start[i]
            run += per_item[i]
        rows = local_rows + offsets[item_of]
        pixel_start = [0]
        pixel_rows = (anyres_tiles(model, sizes) if sizes is not None and values_m.dim() == 4
                      and _packs_tiles(model) else _pixel_rows(values_m, grid))
        for n in pixel_rows:
            pixel_start.append(pixel_start[-1] + n)
        picked = [values_m[pixel_start[i]:pixel_start[i + 1]] for i in encoded]
        shard.media.append(LocalMedia(
            modality=modality,
            pixel_values=torch.cat(picked) if picked else values_m[:0],
            grid_thw=grid[encoded] if grid is not None else None,
            token_mask=local_mask, rows=rows, encoded=tuple(encoded),
            position_ids=image_position_ids[encoded] if patched else None,
            image_sizes=None if sizes is None else sizes[encoded]))
    return {"local_input_ids": local_ids,
            "local_position_ids": cut(positions, positions.dim() - 1),
            "local_target_ids": cut(target_ids),
            "local_document_ids": None if document_ids is None else cut(document_ids),
            "vision": shard}


def _check_image_sizes(model: nn.Module, pixel_values: Tensor, image_sizes: Tensor | None
                       ) -> Tensor:
    """(N, 2) long ``image_sizes`` of an any-resolution tower's images, checked against its
    pixel values: (N, tiles, C, H, W) or every image's tiles concatenated (tiles, C, H, W);
    for a cropping tower (Mistral 3), (N, C, H, W) large enough for every size."""
    name = type(model).__name__
    if image_sizes is None:
        raise ValueError(f"{name} tiles or crops each image by its size: pass image_sizes "
                         "(N, 2) with its pixel values, as its processor gives them")
    sizes = torch.as_tensor(image_sizes).to("cpu", torch.long)
    if sizes.dim() != 2 or sizes.size(1) != 2:
        raise ValueError(f"image_sizes must be (N, 2) (height, width), got {tuple(sizes.shape)}")
    if not _packs_tiles(model):  # a cropping tower: one padded image per row
        if pixel_values.dim() != 4 or pixel_values.size(0) != sizes.size(0) or bool(
                (sizes > torch.tensor(pixel_values.shape[-2:])).any()):
            raise ValueError(f"pixel values {tuple(pixel_values.shape)} are not one image per "
                             f"row, padded to hold each of image_sizes ({sizes.tolist()})")
        return sizes
    if pixel_values.dim() == 5:
        tiles = anyres_tiles(model, sizes)
        if pixel_values.size(0) != sizes.size(0) or max(tiles, default=0) > pixel_values.size(1):
            raise ValueError(f"pixel values {tuple(pixel_values.shape)} do not hold the tiles "
                             f"of {sizes.size(0)} images of image_sizes ({tiles} tiles)")
    elif pixel_values.dim() == 4:
        if sum(anyres_tiles(model, sizes)) != pixel_values.size(0):
            raise ValueError(f"pixel values {tuple(pixel_values.shape)} are not the tiles of "
                             f"the images of image_sizes ({anyres_tiles(model, sizes)} tiles)")
    else:
        raise ValueError(f"{name}'s pixel values are {tuple(pixel_values.shape)}; pass (N, "
                         "tiles, C, H, W) or (tiles, C, H, W)")
    return sizes


def _sized_tokens(model: nn.Module, image_sizes: Tensor) -> list[int]:
    """Placeholder tokens of each image of an any-resolution tower (``image_sizes``): the
    tiles' packed features (LLaVA-NeXT, OneVision) or the cropped image's merged patches
    (Mistral 3)."""
    return (anyres_tokens(model, image_sizes) if _packs_tiles(model)
            else cropped_tokens(model, image_sizes))


def _features(model: nn.Module, family: VisionFamily, pixel_values: Tensor,
              grid_thw: Tensor | None, positions: Tensor | None = None,
              image_sizes: Tensor | None = None):
    """(features (n_rows, H), [deepstack features (n_rows, H)] or None) of the items in
    ``pixel_values``: one call of the tower. Qwen's towers encode a video frame as an image
    of one temporal step (their get_video_features is get_image_features on the tower), so
    images and frames go through ``get_image_features`` together. ``image_sizes`` (N, 2):
    an any-resolution tower's images, tiled or cropped by the model's own code."""
    if family.grids:
        out = model.get_image_features(pixel_values, grid_thw, return_dict=True)
    elif positions is not None:  # Gemma 4: padded patch rows, one image each, and positions
        out = model.get_image_features(pixel_values=pixel_values,
                                       image_position_ids=positions, return_dict=True)
    elif image_sizes is not None:  # the model's own tiling and packing, these images
        out = model.get_image_features(pixel_values=pixel_values, image_sizes=image_sizes,
                                       return_dict=True)
    else:
        out = model.get_image_features(pixel_values=pixel_values, return_dict=True)
    pooled = out.pooler_output
    features = torch.cat(list(pooled), dim=0) if isinstance(pooled, (list, tuple)) else pooled
    features = features.reshape(-1, features.size(-1))
    if image_sizes is not None:
        # the counts per image (anyres_tokens, cropped_tokens) must be the model's own
        want = sum(_sized_tokens(model, image_sizes))
        if features.size(0) != want:
            raise ValueError(f"{type(model).__name__} gave {features.size(0)} feature rows for "
                             f"images of sizes {image_sizes.tolist()}, not the {want} "
                             "tokens counted for them; report this model to easy_context")
    deep = getattr(out, "deepstack_features", None) if family.deepstack else None
    if deep is not None:
        deep = [torch.cat(list(d), dim=0) if isinstance(d, (list, tuple)) else d for d in deep]
    return features, deep


def _outside_decoder(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter outside the decoder and the output head (the tower, its projector)."""
    inside = {id(p) for p in decoder_of(model).parameters()}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        inside |= {id(p) for p in head.parameters()}
    return [p for p in model.parameters() if id(p) not in inside]


def tower_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters outside the decoder and the output head: the vision tower and its
    projector (whatever the family names them), those that train."""
    return [p for p in _outside_decoder(model) if p.requires_grad]


def tower_sharded(model: nn.Module) -> bool:
    """Whether the tower's parameters are gathered collectively when it runs: FSDP2's
    DTensors (a unit of its own, e.g. each vision block, as accelerate wraps the model's
    _no_split_modules) or DeepSpeed ZeRO-3's partitioned parameters (``ds_id``), frozen ones
    included (their forward all-gathers happen all the same). Parameters of a unit that is
    running (FSDP2's root, inside its forward) are plain tensors: gathered already."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - a torch without DTensor shards nothing this way
        DTensor = ()
    return any(isinstance(p, DTensor) or hasattr(p, "ds_id") for p in _outside_decoder(model))


def dummy_image(model: nn.Module, family: VisionFamily, device) -> tuple[Tensor, Tensor | None]:
    """The smallest input the tower takes, zeros: (pixel rows, grid (1, 3)) of one merge
    window (grids: spatial_merge_size x spatial_merge_size patches, one temporal step), or
    one fixed-size image (1, C, H, W). What a rank with nothing to encode runs the tower on
    when the tower is sharded, so that its gathers (and, the output multiplied by zero into
    the loss, its gradient reductions) match the other ranks'. Read from the vision config;
    a ValueError says what is missing."""
    vc = getattr(model.config, "vision_config", None)
    name = type(model).__name__
    dtype = next((p.dtype for p in _outside_decoder(model) if p.is_floating_point()),
                 torch.float32)
    if family.grids:
        need = ("in_channels", "patch_size", "spatial_merge_size")
        if vc is None or any(getattr(vc, k, None) is None for k in need):
            raise ValueError(f"{name}'s vision_config does not give {', '.join(need)}, from "
                             "which a rank without images builds the input it runs the "
                             "sharded tower on; train with DDP (the tower not sharded)")
        side = int(vc.spatial_merge_size)
        width = (int(vc.in_channels) * int(getattr(vc, "temporal_patch_size", 1) or 1)
                 * int(vc.patch_size) ** 2)
        grid = torch.tensor([[1, side, side]], device=device)
        return torch.zeros(side * side, width, dtype=dtype, device=device), grid
    size = getattr(vc, "image_size", None)
    if size is None:
        raise ValueError(f"{name}'s vision_config gives no image_size, from which a rank "
                         "without images builds the input it runs the sharded tower on; "
                         "train with DDP (the tower not sharded)")
    height, width = (size, size) if isinstance(size, int) else tuple(size)
    channels = int(getattr(vc, "num_channels", 3) or 3)
    if family.image_sizes:
        # an any-resolution tower: the image of dummy_image_sizes, as its processor would
        # give it (LLaVA-NeXT, OneVision: all its tiles; Mistral 3: 2 x 2 merged patches)
        sizes = dummy_image_sizes(model, family, "cpu")
        (height, width), = sizes.tolist()
        tiles = anyres_tiles(model, sizes)[0] if _packs_tiles(model) else 1
        return torch.zeros(tiles, channels, height, width, dtype=dtype, device=device), None
    return torch.zeros(1, channels, int(height), int(width), dtype=dtype, device=device), None


def dummy_image_sizes(model: nn.Module, family: VisionFamily, device) -> Tensor | None:
    """(1, 2) image_sizes of ``dummy_image`` for an any-resolution tower, else None: one tile
    of the tower's image_size (LLaVA-NeXT, OneVision), or 2 x 2 merged patches (Mistral 3:
    its patch_size x spatial_merge_size is the least it crops, but get_image_features
    squeezes a single token's features to one vector)."""
    if not family.image_sizes:
        return None
    if _packs_tiles(model):
        size = model.config.vision_config.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
    else:
        height = width = 2 * _vision_tower(model).patch_size * model.config.spatial_merge_size
    return torch.tensor([[int(height), int(width)]], dtype=torch.long, device=device)


def _encode(model: nn.Module, family: VisionFamily, vision: VisionShard, device,
            sharded: bool):
    """[(media, features, deep)] of this rank's encoded items, from ONE tower call (all
    modalities together), and a zero (a scalar in the graph of the tower's output) when the
    rank has nothing to encode and the tower is sharded: then the tower runs once on
    ``dummy_image``, so every rank calls the tower exactly once per step, whatever it holds,
    and every tower parameter gets a (zero) gradient, reduced like the others' ranks'."""
    parts = [m for m in vision.media if m.encoded]
    if not parts:
        if not sharded:
            return [], None
        pixels, grid = dummy_image(model, family, device)
        features, deep = _features(model, family, pixels, grid,
                                   image_sizes=dummy_image_sizes(model, family, "cpu"))
        zero = features.sum() * 0.0
        for d in deep or ():
            zero = zero + d.sum() * 0.0
        return [], zero
    dtype = parts[0].pixel_values.dtype
    pixels = torch.cat([m.pixel_values.to(dtype) for m in parts])
    grid = torch.cat([m.grid_thw for m in parts]) if family.grids else None
    patched = all(m.position_ids is not None for m in parts)
    positions = torch.cat([m.position_ids for m in parts]) if patched else None
    sized = all(m.image_sizes is not None for m in parts)
    # any-resolution towers: their images' sizes go with the pixels (tiles or padded images
    # of the encoded images only, in the same order)
    image_sizes = torch.cat([m.image_sizes for m in parts]) if sized else None
    features, deep = _features(model, family, pixels, grid, positions, image_sizes)
    if family.grids:
        sizes = [int((m.grid_thw.prod(-1) // family.merge).sum()) for m in parts]
    elif patched:  # Gemma 4: each image's soft tokens from its real patches
        sizes = [sum(_patch_tokens(model, m.pixel_values, m.position_ids)) for m in parts]
    elif sized:  # LLaVA-NeXT, OneVision, Mistral 3: the counts checked in _features
        sizes = [sum(_sized_tokens(model, m.image_sizes)) for m in parts]
    else:
        sizes = [features.size(0) // sum(len(m.encoded) for m in parts) * len(m.encoded)
                 for m in parts]
    split = lambda t: torch.split(t, sizes)  # noqa: E731
    deeps = list(zip(*[split(d) for d in deep])) if deep is not None else [None] * len(parts)
    return list(zip(parts, split(features), deeps)), None


def vision_embeddings(model: nn.Module, input_ids: Tensor, vision: VisionShard
                      ) -> tuple[Tensor, dict]:
    """This rank's input embeddings (B, S_local, H), its image and video tokens replaced by
    their features, and the decoder's extra keyword arguments (deepstack). The tower runs
    once (images and video frames together); with a sharded tower (FSDP2, ZeRO-3,
    ``tower_sharded``) it runs once on every rank, on a dummy image where the rank has
    nothing to encode (its output times zero in the embeddings)."""
    family = describe(model)
    extra = {}
    if _takes_per_layer_inputs(model):
        # Gemma 4: the decoder adds per-layer embeddings of the token ids, where the model's
        # own forward gives every placeholder (image, video, audio) the pad token's; the
        # decoder cannot recover them from embeddings holding image features
        input_ids = _placeholders_padded(model, input_ids)
        extra["per_layer_inputs"] = decoder_of(model).get_per_layer_inputs(input_ids, None)
    sharded = tower_sharded(model)
    if sharded:  # every rank reads it, so that a config without it is refused by all alike
        dummy_image(model, family, input_ids.device)
    embeds = model.get_input_embeddings()(input_ids)
    visual_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    deep_parts: list[tuple[Tensor, list[Tensor]]] = []
    encoded, zero = _encode(model, family, vision, input_ids.device, sharded)
    for media, features, deep in encoded:
        mine = features.to(embeds.dtype)[media.rows]     # (n_local_tokens, H) in mask order
        embeds = embeds.masked_scatter(media.token_mask.unsqueeze(-1), mine)
        visual_mask = visual_mask | media.token_mask
        if deep is not None:
            deep_parts.append((media.token_mask, [d[media.rows].to(embeds.dtype) for d in deep]))
    if zero is not None:
        embeds = embeds + zero.to(embeds.dtype)
    elif not encoded:
        # no image token here: still give the tower a (zero) gradient, so that DDP's
        # reduction sees the same parameters with gradients on every rank
        embeds = embeds + sum(p.view(-1)[:1].sum() for p in tower_parameters(model)) * 0.0
    if family.deepstack and deep_parts:
        # one (n_visual_local, H) per deepstack layer, in the order of the joint visual mask
        layers = len(deep_parts[0][1])
        joint = []
        for layer in range(layers):
            rows = embeds.new_zeros(int(visual_mask.sum()), embeds.size(-1))
            for mask, deep in deep_parts:
                rows = rows.masked_scatter(mask[visual_mask].unsqueeze(-1), deep[layer])
            joint.append(rows)
        extra.update(visual_pos_masks=visual_mask, deepstack_visual_embeds=joint)
    return embeds, extra


def _check_deepstack_max_length(model: nn.Module, keep_every: int) -> None:
    """Refuse, on every rank alike (whether or not it holds images), what max-length mode
    cannot do with deepstack features, which the decoder adds to the hidden states after
    each of its first ``len(deepstack_visual_indexes)`` layers (Qwen3-VL)."""
    if keep_every > 1:
        # the nested recompute regenerates a layer's input by running the layer before it,
        # without the features added between them
        raise ValueError(f"max-length mode's nested recompute (keep_every={keep_every}) cannot "
                         f"regenerate {type(model).__name__}'s layer inputs: its decoder adds "
                         "deepstack image features between layers; use keep_every=1 "
                         "(--keep-every 1) with images")
    vision_config = getattr(model.config, "vision_config", None)
    deep = len(getattr(vision_config, "deepstack_visual_indexes", None) or ())
    layers = len(decoder_of(model).layers)
    if deep >= layers:
        # then the last layer's output changes before the final norm, which max-length mode
        # applies inside the loss to that output (maxlen._fold_final_norm would stop the
        # ranks with images mid-step)
        raise ValueError(f"{type(model).__name__} adds deepstack image features after each of "
                         f"its first {deep} decoder layers, the last ({layers}) included: "
                         "max-length mode applies the final norm to the last layer's own "
                         "output; train it without max-length mode")


def _takes_per_layer_inputs(model: nn.Module) -> bool:
    decoder = decoder_of(model)
    return bool(getattr(decoder, "hidden_size_per_layer_input", None)) and \
        "per_layer_inputs" in inspect.signature(decoder.forward).parameters


def decoder_input_ids(model: nn.Module, input_ids: Tensor) -> Tensor:
    """The ids a vision-language model's own forward hands its decoder: Gemma 4's (a decoder
    with per-layer inputs) turns every multimodal placeholder into the pad token first, a
    generated one included; the others' as given."""
    if is_vision_language(model) and _takes_per_layer_inputs(model):
        return _placeholders_padded(model, input_ids)
    return input_ids


def _placeholders_padded(model: nn.Module, input_ids: Tensor) -> Tensor:
    """input_ids with every multimodal placeholder (the config's image, video and audio token
    ids) replaced by the text config's pad token, as Gemma 4's forward does before embedding."""
    config = model.config
    pad = (getattr(config, "text_config", None) or config).pad_token_id
    ids = [getattr(config, f"{m}_token_id", None) for m in ("image", "video", "audio")]
    placeholder = torch.zeros_like(input_ids, dtype=torch.bool)
    for token in ids:
        if token is not None:
            placeholder |= input_ids == token
    return torch.where(placeholder, torch.full_like(input_ids, pad), input_ids)


def vision_language_loss(model: nn.Module, head: nn.Linear | None, input_ids: Tensor,
                         position_ids: Tensor, target_ids: Tensor, vision: VisionShard,
                         extra: dict, chunked: bool, chunk_size: int | None, group,
                         num_items_in_batch, token_stats: Tensor | None) -> Tensor:
    """causal_lm_loss for a vision-language step: this rank's embeddings with its images'
    features, the decoder on them, then the head (chunked or whole logits)."""
    from ..memory.loss import chunked_cross_entropy, default_chunk_size, logits_cross_entropy
    from ..memory.maxlen import max_length_settings

    if head is None:
        raise ValueError(f"{type(model).__name__}'s logits are not a plain linear layer of the "
                         "decoder's last hidden state; sequence parallelism with images needs "
                         "one (its loss runs the decoder and the head itself)")
    settings = max_length_settings(model)
    if settings is not None and describe(model).deepstack:
        _check_deepstack_max_length(model, settings.keep_every)
    embeds, more = vision_embeddings(model, input_ids, vision)
    if any(vision.image_spans):
        more[IMAGE_SPANS_KWARG] = vision.image_spans
    if chunked and settings is not None:
        # max-length mode: the decoder's tiled layers on the embeddings with this rank's
        # image features scattered in, then the final norm folded into the loss's chunks
        from ..memory.maxlen import max_length_loss
        from ..utils.fsdp import unshard_for_direct_use

        if chunk_size is None:
            chunk_size = default_chunk_size(head.out_features, head.weight.device)
        unshard_for_direct_use(head)  # read directly, never called (as the text loss)
        return max_length_loss(model, head, None, position_ids, target_ids,
                               {**extra, **more, "inputs_embeds": embeds}, chunk_size, group,
                               num_items_in_batch, None, token_stats)
    hidden = decoder_of(model)(inputs_embeds=embeds, position_ids=position_ids, use_cache=False,
                               **extra, **more).last_hidden_state
    if chunked:
        from ..utils.fsdp import unshard_for_direct_use

        if chunk_size is None:
            chunk_size = default_chunk_size(head.out_features, head.weight.device)
        unshard_for_direct_use(head)  # read directly below, never called (as the text loss)
        return chunked_cross_entropy(hidden, head.weight, target_ids, head.bias,
                                     chunk_size=chunk_size, group=group,
                                     num_items_in_batch=num_items_in_batch, stats=token_stats)
    return logits_cross_entropy(head(hidden), target_ids, group=group,
                                num_items_in_batch=num_items_in_batch, stats=token_stats)


_GUARD_ATTR = "_easy_context_vision_guard"
PIXEL_KWARGS = ("pixel_values", "pixel_values_videos")


def guard_own_forward(model: nn.Module, active) -> None:
    """Refuse images given to the model's own forward while its decoder runs a sharding
    method (``active()``): that forward would put every image's features into one shard's
    placeholder tokens (or fail on the count) and number positions from the shard. Installed
    by apply_sequence_parallel; applying again replaces it."""
    old = getattr(model, _GUARD_ATTR, None)
    if old is not None:
        old.remove()

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        given = [k for k in PIXEL_KWARGS if kwargs.get(k) is not None]
        if given and active():
            raise ValueError(
                f"{type(module).__name__} got {', '.join(given)} in its own forward under "
                "sequence parallelism, which would run on a shard as if it were the whole "
                "sequence; cut the step with easy_context.prepare_vision_inputs and compute the "
                "loss with easy_context.causal_lm_loss(..., vision=local['vision'])")
        return None

    setattr(model, _GUARD_ATTR, model.register_forward_pre_hook(hook, with_kwargs=True))
