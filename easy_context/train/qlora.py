"""QLoRA: LoRA adapters on a base whose decoder-layer linear weights are 4-bit NF4.

``easy-context train --lora-rank R --lora-4bit`` (FSDP engine) stores every linear weight of
the decoder layers in bitsandbytes' NF4 format (4 bits a weight, one fp32 scale per block of
64: ``quantize_4bit(w, quant_type="nf4", blocksize=64)``, what transformers' ``load_in_4bit``
with ``bnb_4bit_quant_type="nf4"`` makes of the same weights). The embeddings, norms and
output head stay as they were. Each product dequantizes its weight to the input's dtype for
that product only (``bitsandbytes.matmul_4bit``); the adapters run beside it in the usual way.

The 4-bit weights are not parameters of the model: FSDP2 neither shards nor gathers them, its
``to_empty`` does not touch them, and checkpoints leave them out as they leave out every
frozen weight. Every rank holds all of them, quantized as the model is built (each rank reads
one weight at a time from the safetensors folder, in full), so a step needs no communication
for them; the price is memory that does not shrink with more ranks: half a byte a weight
where a sharded bf16 base costs 2 / N (the planner's LoRA table shows where each wins).

bitsandbytes quantizes and multiplies on the CPU as well as on CUDA (tested here on CPU with
0.50.2: training on 1 and 2 gloo ranks; no GPU to test on); the ``qlora`` extra installs it.
Its CPU backend has two branches that depend on the CPU (not on ``ATEN_CPU_CAPABILITY``):
dequantization is its C kernel where its native library loads and the same formula in torch
ops where not (the same weights, bit for bit); and on CPUs with AVX-512 BF16
(``has_avx512bf16()``) its ``Linear4bit`` repacks the weight for a bf16 kernel in eval mode
without grad (in_features a multiple of 64 only). ``NF4Linear`` hands ``matmul_4bit`` the plain
quant state, so it never takes the bf16 kernel: every forward of ours dequantizes to the
input's dtype, for any layer shape, on every CPU. (A user who puts the exported adapter on a
transformers 4-bit base on such a CPU gets bitsandbytes' bf16 path and its shape limits.) DeepSpeed's ZeRO-3 would partition these
tensors like any other, which bitsandbytes' layout does not survive: ``--lora-4bit`` needs
``--engine fsdp``.

``--merge`` folds the adapters into the dequantized 4-bit weights, so the merged model
computes what was trained (not into the original weights, which the adapters never saw).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .weights import SafetensorsFolder

log = logging.getLogger(__name__)

QUANT_TYPE = "nf4"
BLOCK = 64


def require_bitsandbytes():
    try:
        import bitsandbytes
    except ImportError as e:
        raise ImportError("--lora-4bit needs the bitsandbytes package: pip install "
                          "'easy-context[qlora]' (or pip install bitsandbytes)") from e
    return bitsandbytes


class NF4Linear(nn.Module):
    """A frozen linear layer whose weight is held in NF4 (see the module docstring). The bias,
    if any, stays a (frozen) parameter, sharded and loaded like the others."""

    def __init__(self, in_features: int, out_features: int, bias: nn.Parameter | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = bias
        self.packed: torch.Tensor | None = None  # (out * in / 2, 1) uint8
        self.quant_state = None  # bitsandbytes' QuantState: the block scales, shape, dtype

    def quantize_(self, weight: torch.Tensor) -> None:
        """Store ``weight`` (out, in), quantized where it is (the rank's device)."""
        from bitsandbytes.functional import quantize_4bit

        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight of shape {tuple(weight.shape)} for a linear layer "
                             f"{self.in_features} -> {self.out_features}")
        if not weight.is_floating_point() or weight.dtype == torch.float64:
            weight = weight.float()
        self.packed, self.quant_state = quantize_4bit(
            weight.contiguous(), blocksize=BLOCK, quant_type=QUANT_TYPE, compress_statistics=False)

    def dequantize(self) -> torch.Tensor:
        """The weight (out, in) the layer computes with, in the dtype it was stored in."""
        from bitsandbytes.functional import dequantize_4bit

        return dequantize_4bit(self.packed, self.quant_state)

    @property
    def weight(self) -> torch.Tensor:
        """The weight the layer computes with, dequantized (out, in), for code that reads a
        linear layer's weight instead of calling it: Mamba-2 layers (Granite 4, Bamba,
        Nemotron-H, ...) hand ``out_proj.weight`` to their fused training kernel, which on
        the sequence-parallel path declines (easy_context/integrations/hf_recurrent.py) and
        the layer then calls ``out_proj`` itself. Not a parameter: nothing trains it."""
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import bitsandbytes as bnb

        bias = None if self.bias is None else self.bias.to(x.dtype)
        return bnb.matmul_4bit(x, self.packed.t(), quant_state=self.quant_state, bias=bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, nf4"


def quantized_linears(model: nn.Module) -> dict[str, nn.Module]:
    """The linear layers of the decoder layers that are not adapters, by name: what a 4-bit
    base quantizes (a LoRA module's ``base_layer``, or a linear module without an adapter)."""
    from .weights import decoder_layers

    inside = {id(m) for layer in decoder_layers(model) for m in layer.modules()}
    return {name: m for name, m in model.named_modules()
            if id(m) in inside and isinstance(m, nn.Linear)
            and ".lora_A." not in f"{name}." and ".lora_B." not in f"{name}."}


def quantize_base(model: nn.Module, folder: SafetensorsFolder | None, device: torch.device,
                  base_name) -> int:
    """Replace each quantized linear layer of ``model`` (built empty) by an NF4Linear filled
    from ``folder``; ``base_name`` maps a model name to the checkpoint's. Returns how many
    weights were quantized."""
    require_bitsandbytes()
    if folder is None:
        raise ValueError("--lora-4bit reads the base from a local model folder (safetensors); "
                         "download the model first")
    count = 0
    for name, linear in quantized_linears(model).items():
        key = base_name(f"{name}.weight")
        if key not in folder.keys():
            raise ValueError(f"--lora-4bit: {key} is not in {folder.folder}: the 4-bit base reads "
                             "the weights under the model's own names")
        layer = NF4Linear(linear.in_features, linear.out_features, linear.bias)
        layer.quantize_(folder.read(key).to(device))
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, layer)
        count += linear.in_features * linear.out_features
    if count == 0:
        raise ValueError("--lora-4bit: the decoder layers have no linear layers to quantize")
    return count


def quantized_weight_names(model: nn.Module) -> set[str]:
    """The names under which a state dict of the full-precision model holds the weights that
    are 4-bit here (not parameters of this model: quantize_base filled them)."""
    return {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, NF4Linear)}


def dequantized_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The 4-bit weights as fp32 CPU tensors, under the names a merged state dict uses."""
    return {f"{name}.weight": m.dequantize().float().cpu()
            for name, m in model.named_modules() if isinstance(m, NF4Linear)}
