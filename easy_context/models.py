"""Loading models: config with RoPE overrides, weights (safetensors only), tokenizer.

Shared by training, evaluation, the planner and the demo.

    model, tokenizer = load_model_and_tokenizer("path/to/model", rope_theta=5e6,
                                                rope_scaling="linear:4", device="cpu")

In transformers 5 the RoPE settings live in ``config.rope_parameters``
(``{"rope_theta": ..., "rope_type": "default", ...}``; models with several layer types keep
one such dict per type). Rotary tables are built when the model is built, so overrides are
written into the config first and the model is then built from it:
``AutoConfig.from_pretrained`` -> change -> ``from_pretrained(path, config=config)``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers import PreTrainedModel, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_rope_scaling(value: str | dict | None) -> dict[str, Any] | None:
    """``'{"rope_type": "yarn", "factor": 4}'`` or ``'yarn:4'`` -> ``{"rope_type": "yarn",
    "factor": 4.0}``; ``"type"`` (the transformers 4 key) is accepted for ``"rope_type"``."""
    if value is None or isinstance(value, dict):
        scaling = value
    elif value.lstrip().startswith("{"):
        try:
            scaling = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--rope-scaling is not valid JSON ({e}): {value!r}") from e
    else:
        kind, sep, factor = value.partition(":")
        try:
            scaling = {"rope_type": kind.strip(), "factor": float(factor)}
        except ValueError:
            sep = ""
        if not sep or not kind.strip():
            raise ValueError(f"--rope-scaling must be JSON or TYPE:FACTOR (e.g. linear:4, "
                             f"yarn:8), got {value!r}")
    if scaling is None:
        return None
    scaling = dict(scaling)
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if "rope_type" not in scaling:
        raise ValueError(f"--rope-scaling needs a rope_type (linear, dynamic, yarn, llama3, ...): "
                         f"{value!r}")
    return scaling


def apply_rope_overrides(config: PretrainedConfig, rope_theta: float | None = None,
                         rope_scaling: str | dict | None = None) -> PretrainedConfig:
    """Write a RoPE base and/or scaling into ``config.rope_parameters`` (in place, returned)."""
    scaling = parse_rope_scaling(rope_scaling)
    if rope_theta is None and scaling is None:
        return config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    params = getattr(text, "rope_parameters", None)
    if params is None:
        raise ValueError(f"{type(config).__name__} has no rope_parameters: the model does not use "
                         "RoPE, so --rope-theta/--rope-scaling do not apply")
    # Several layer types (e.g. full and sliding attention) keep one dict each.
    per_type = all(isinstance(v, dict) for v in params.values())
    for p in params.values() if per_type else [params]:
        if scaling is not None:
            p.update(scaling)
        if rope_theta is not None:
            p["rope_theta"] = float(rope_theta)
    text.rope_parameters = params
    logger.info("RoPE parameters: %s", params)
    return config


def resolve_dtype(name: str | None, device: torch.device | str) -> torch.dtype:
    """``bf16``/``fp16``/``fp32``; None: bf16 on CUDA, fp32 on CPU (bf16 matmuls are slow there)."""
    if name is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def check_model_path(path: str, weights: bool = False) -> str:
    """``path`` if it is a model folder (with its safetensors ``weights`` when asked), or a
    Hub name, which transformers resolves (from its cache when offline); else a
    FileNotFoundError that says what is missing."""
    p = Path(path).expanduser()
    if p.exists():
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"model folder {path} has no config.json; pass a folder saved "
                                    "with save_pretrained")
        if weights and not any(p.glob("*.safetensors")):
            raise FileNotFoundError(f"model folder {path} has no safetensors weights "
                                    "(model.safetensors); save it with save_pretrained("
                                    "safe_serialization=True)")
        return str(p)
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise FileNotFoundError(f"model folder {path} does not exist")
    return path


def model_heads(path: str) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) from a local model folder's config.json, to check a
    sequence-parallel method before any rank loads the model; (None, None) when unknown."""
    file = Path(path).expanduser() / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None, None
    config = config.get("text_config") or config  # multimodal models keep it there
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    ok = all(isinstance(h, int) for h in (heads, kv_heads))
    return (heads, kv_heads) if ok else (None, None)


def load_config(path: str, rope_theta: float | None = None, rope_scaling: str | dict | None = None,
                trust_remote_code: bool = False) -> PretrainedConfig:
    """The model's config with the RoPE overrides applied."""
    config = AutoConfig.from_pretrained(check_model_path(path), trust_remote_code=trust_remote_code)
    return apply_rope_overrides(config, rope_theta, rope_scaling)


def plain_attention(config: PretrainedConfig, wanted: str = "sdpa") -> str:
    """``wanted``, or "eager" for the families that have no sdpa path (Gemma 2: its
    soft-capping) -- the plain attention a model is built with before
    ``apply_sequence_parallel`` switches it."""
    if wanted != "sdpa":
        return wanted
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None) if hasattr(
        AutoModelForCausalLM, "_model_mapping") else None
    return "eager" if cls is not None and getattr(cls, "_supports_sdpa", True) is False else wanted


def load_model_and_tokenizer(path: str, *, device: torch.device | str = "cpu",
                             dtype: str | torch.dtype | None = None,
                             rope_theta: float | None = None,
                             rope_scaling: str | dict | None = None,
                             trust_remote_code: bool = False,
                             attn_implementation: str = "sdpa",
                             tokenizer: bool = True,
                             ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """A causal LM (safetensors only, eval mode, on ``device``) and its tokenizer (None with
    ``tokenizer=False``).

    ``trust_remote_code`` is off by default: a model folder's own Python code runs only when
    asked for. The attention implementation is a plain one; ``apply_sequence_parallel``
    switches it afterwards.
    """
    local = check_model_path(path)
    config = load_config(local, rope_theta, rope_scaling, trust_remote_code)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(
        local, config=config, dtype=torch_dtype, use_safetensors=True,
        trust_remote_code=trust_remote_code,
        attn_implementation=plain_attention(config, attn_implementation))
    model.to(device).eval()
    if not tokenizer:
        return model, None
    if has_tokenizer(local) is False:
        raise FileNotFoundError(f"model folder {path} has no tokenizer ({TOKENIZER_FILES[0]}); "
                                "save one there with tokenizer.save_pretrained")
    return model, AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code)


# Files a saved tokenizer has at least one of (fast, its config, sentencepiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model")


def has_tokenizer(path: str) -> bool | None:
    """Whether a local model folder holds a tokenizer; None for a Hub name (unknown offline).
    Without one, transformers would try to build it from the model type and fail on a
    missing converter, far from the point."""
    p = Path(path).expanduser()
    if not p.is_dir():
        return None
    return any((p / name).exists() for name in TOKENIZER_FILES)


def pad_token_id(tokenizer: PreTrainedTokenizerBase | None, config: PretrainedConfig) -> int:
    """The id to pad with: the tokenizer's pad or EOS, else the model config's, else 0.
    (Padded positions are never scored; the id only has to be a valid one.)"""
    sources = [tokenizer.pad_token_id, tokenizer.eos_token_id] if tokenizer is not None else []
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    sources += [getattr(text, "pad_token_id", None), getattr(text, "eos_token_id", None)]
    for value in sources:
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0
