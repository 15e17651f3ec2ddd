"""The model to train: fp32 master weights, RoPE overrides, a tokenizer if the folder has one."""

from __future__ import annotations

import logging

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..models import check_model_path, load_config
from .config import TrainConfig

log = logging.getLogger(__name__)


def load_model_and_tokenizer(config: TrainConfig):
    path = check_model_path(config.model)
    model_config = load_config(path, config.rope_theta, config.rope_scaling, config.trust_remote_code)
    # Master weights stay fp32; FSDP's mixed-precision policy computes in bf16.
    model = AutoModelForCausalLM.from_pretrained(
        path, config=model_config, dtype=torch.float32, use_safetensors=True,
        trust_remote_code=config.trust_remote_code, attn_implementation="sdpa")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError, TypeError):
        log.info("no tokenizer in %s: the export will hold the model only", path)
        tokenizer = None
    return model, tokenizer
