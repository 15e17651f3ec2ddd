"""The model to train: built empty, then filled by its engine (easy_context.train.weights).

Master weights are fp32 (FSDP's mixed-precision policy computes in bf16). RoPE overrides go
into the config before the model is built, as the rotary tables are computed then.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PretrainedConfig
from transformers.initialization import no_init_weights

from ..models import check_model_path, load_config, plain_attention
from .config import TrainConfig
from .weights import Pretrained, params_on_meta

log = logging.getLogger(__name__)


def build_empty_model(config: TrainConfig,
                      init_context: Callable[[PretrainedConfig], contextlib.AbstractContextManager],
                      buffers_outside: bool = False):
    """The model of ``config.model``, built under ``init_context(model_config)`` (parameters
    on the meta device, or DeepSpeed's zero.Init), and where its weights come from.

    ``buffers_outside``: replace the buffers by those of a build outside the context (with
    its parameters on the meta device: free). zero.Init casts every floating-point tensor
    made inside it to the compute dtype, the rotary tables too; bf16 rounds inv_freq by up
    to 0.4%, which shifts the phase of far positions by whole turns.
    """
    path = check_model_path(config.model)
    model_config = load_config(path, config.rope_theta, config.rope_scaling, config.trust_remote_code)

    auto = _auto_class(model_config)

    def build():
        return auto.from_config(
            model_config, dtype=torch.float32, trust_remote_code=config.trust_remote_code,
            attn_implementation=plain_attention(model_config))

    reference = None
    if buffers_outside:
        # Built first, outside the context: this also imports the modeling code outside it.
        # zero.Init wraps the __init__ of every module class made while it is entered and puts
        # back, on exit, the __init__ the class had when it was made, undoing what decorators
        # applied after (kernels' use_kernelized_func gives each recurrent layer its kernel
        # functions in __init__: every model built afterwards in the process would lack them,
        # and the hybrid would be refused).
        with params_on_meta():
            reference = build()
    # Under zero.Init (buffers_outside) every parameter is a partition already: transformers'
    # weight initialisation would write whole tensors into them (Qwen3-Next's and Mamba-2's
    # A_log are copied in, and fail), and every value is read from the checkpoint anyway. So
    # it is skipped, as transformers' own from_pretrained does under ZeRO-3.
    with init_context(model_config), (no_init_weights() if buffers_outside
                                      else contextlib.nullcontext()):
        model = build()
    if reference is not None:
        for name, buf in reference.named_buffers():
            owner, _, leaf = name.rpartition(".")
            module = model.get_submodule(owner)
            module._buffers[leaf] = buf.to(module._buffers[leaf].device)
    try:  # what from_pretrained would have read, so that the export carries it on
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass

    def load_full():
        return auto.from_pretrained(
            path, config=model_config, dtype=torch.float32, use_safetensors=True,
            trust_remote_code=config.trust_remote_code,
            attn_implementation=plain_attention(model_config))

    return model, Pretrained(path, load_full)


def _auto_class(model_config: PretrainedConfig):
    """AutoModelForCausalLM, or for a vision-language model (a config with a vision tower,
    which the causal-LM registry does not map) AutoModelForImageTextToText."""
    from .vision import is_vision_config

    if type(model_config) not in AutoModelForCausalLM._model_mapping and \
            is_vision_config(model_config):
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def load_tokenizer(config: TrainConfig):
    path = check_model_path(config.model)
    from .vision import is_vision_config

    if is_vision_config(load_config(path, trust_remote_code=config.trust_remote_code)):
        # a vision-language model: its processor (tokenizer, image processor, template) goes
        # into the export, as from_pretrained reads it
        from transformers import AutoProcessor

        try:
            return AutoProcessor.from_pretrained(path, trust_remote_code=config.trust_remote_code)
        except (OSError, ValueError, TypeError, ImportError):
            pass
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code)
    except (OSError, ValueError, TypeError):
        log.info("no tokenizer in %s: the export will hold the model only", path)
        return None
