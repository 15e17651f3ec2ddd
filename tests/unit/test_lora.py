"""LoRA's pieces in one process: flags, the folder view the engines load through, the
adapters' first values, the merge, the errors; and that everything else works without peft."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from easy_context.train.config import TrainConfig
from tests.train_fixtures import TINY, tiny_dataset_dir, tiny_model_dir

BLOCK_PEFT = "import sys; sys.modules['peft'] = None  # importing peft now raises ImportError\n"


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{"model": "m", "dataset": "d", **kw})


@pytest.mark.parametrize("kw, message", [
    ({"merge": True}, "--merge apply to LoRA: add --lora-rank"),
    ({"lora_alpha": 16}, "--lora-alpha apply to LoRA"),
    ({"lora_targets": "q_proj"}, "--lora-targets apply to LoRA"),
    ({"lora_rank": 0}, "--lora-rank must be >= 1"),
    ({"lora_rank": 4, "lora_alpha": 0}, "--lora-alpha must be > 0"),
    ({"lora_4bit": True}, "--lora-4bit apply to LoRA"),
    ({"lora_rank": 4, "lora_4bit": True, "engine": "deepspeed"}, "--lora-4bit needs --engine fsdp"),
    # max-length mode runs the adapters (generic path), but the planner does not plan LoRA
    ({"lora_rank": 4, "auto_memory": True}, "--auto-memory does not plan LoRA runs"),
])
def test_flags_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw).validate()


def test_max_length_flags_are_accepted_with_lora():
    """Forced tiles and head chunks run the adapters (their layers take max-length mode's
    generic path: tests/dist/test_train_maxlen.py trains one like the untiled layers)."""
    _config(lora_rank=4, mlp_tile="512").validate()
    _config(lora_rank=4, mlp_tile="8", head_chunk="2", keep_every=2).validate()


def test_without_peft_the_package_imports_trains_and_lora_names_the_extra(tmp_path):
    tiny_model_dir(tmp_path / "model")
    tiny_dataset_dir(tmp_path / "data", seq_length=16, rows=4)
    common = ["train", "--model", str(tmp_path / "model"), "--dataset", str(tmp_path / "data"),
              "--seq-length", "16", "--max-train-steps", "1", "--mixed-precision", "fp32"]
    script = BLOCK_PEFT + "from easy_context.cli import main; sys.exit(main(sys.argv[1:]))"
    lora = subprocess.run([sys.executable, "-c", script, *common, "--lora-rank", "4",
                           "--output-dir", str(tmp_path / "lora")],
                          capture_output=True, text=True, timeout=300)
    assert lora.returncode == 2, lora.stderr
    assert "pip install 'easy-context[lora]'" in lora.stderr
    plain = subprocess.run([sys.executable, "-c", script, *common,
                            "--output-dir", str(tmp_path / "plain")],
                           capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert (tmp_path / "plain" / "final_model" / "model.safetensors").is_file()


peft = pytest.importorskip("peft")

from easy_context.train.lora import (  # noqa: E402
    LoRAFolder,
    inject_lora,
    initial_adapter,
    merged_state_dict,
    peft_config,
    to_peft_keys,
)
from easy_context.train.weights import SafetensorsFolder, checkpoint_names  # noqa: E402


def _lora_model(rank=4, targets="all-linear", seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    modules = inject_lora(model, peft_config(_config(lora_rank=rank, lora_targets=targets)))
    return model, modules


def test_only_the_adapters_train_and_they_start_as_the_base():
    model, modules = _lora_model(targets="q_proj,v_proj")
    assert sorted({n.rsplit(".", 1)[-1] for n in modules}) == ["q_proj", "v_proj"]
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    assert len(trainable) == 2 * 2 * TINY["num_hidden_layers"]


def test_the_first_adapter_values_are_peft_s_and_the_same_everywhere():
    name = "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    a = initial_adapter(name, (4, 32), seed=7)
    assert torch.equal(a, initial_adapter(name, (4, 32), seed=7))  # every rank, every run
    assert not torch.equal(a, initial_adapter(name, (4, 32), seed=8))
    assert not torch.equal(a, initial_adapter(name.replace("q_proj", "k_proj"), (4, 32), seed=7))
    assert a.abs().max() <= 1 / math.sqrt(32) and a.std() > 0.5 / math.sqrt(3 * 32)
    b = initial_adapter(name.replace("lora_A", "lora_B"), (32, 4), seed=7)
    assert torch.equal(b, torch.zeros(32, 4))  # B = 0: the model starts as the base model


def test_folder_view_maps_every_parameter_of_the_lora_model(tmp_path):
    tiny_model_dir(tmp_path / "model")
    model, modules = _lora_model()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if ".lora_" in n}
    view = LoRAFolder(SafetensorsFolder(tmp_path / "model"), set(modules), shapes, seed=3)
    names = checkpoint_names(model, view)  # what both engines use to load
    assert names is not None and set(names) >= {n for n, _ in model.named_parameters()}
    base = SafetensorsFolder(tmp_path / "model")
    q = "model.layers.1.self_attn.q_proj"
    assert torch.equal(view.read(f"{q}.base_layer.weight", (2, 5)), base.read(f"{q}.weight", (2, 5)))
    assert torch.equal(view.read("lm_head.weight"), base.read("lm_head.weight"))
    a = f"{q}.lora_A.default.weight"
    assert torch.equal(view.read(a, (1, 3)), initial_adapter(a, shapes[a], 3)[1:3])


def test_merge_equals_peft_s_merge_and_the_saved_keys_are_peft_s(tmp_path):
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM

    from easy_context.train.lora import write_adapter

    model, modules = _lora_model()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=gen))
    state = model.state_dict()
    merged = merged_state_dict(state, {n: m.scaling["default"] for n, m in modules.items()})
    # peft's own path: our adapter folder loaded by PeftModel on the base, merged by peft
    write_adapter({k: v for k, v in state.items() if ".lora_" in k},
                  peft_config(_config(lora_rank=4)), None, tmp_path / "adapter")
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **TINY))
    base.load_state_dict({k.replace(".base_layer.", "."): v for k, v in state.items()
                          if ".lora_" not in k})
    reference = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    assert merged.keys() == reference.keys()
    for key, value in reference.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-6, atol=1e-6, msg=key)
    assert list(to_peft_keys({"model.layers.0.mlp.up_proj.lora_A.default.weight": 0})) == [
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"]


@pytest.mark.parametrize("targets, message", [
    ("lm_head", "only go into the decoder layers"),
    ("no_such_proj", "the model's linear modules are"),
])
def test_bad_targets_say_what_to_change(targets, message):
    with pytest.raises(ValueError, match=message):
        _lora_model(targets=targets)


def test_adapters_on_a_recurrent_layer_s_convolution_are_refused():
    # Qwen3-Next's gated DeltaNet hands its conv1d module to a kernel function that reads
    # conv1d.weight (transformers' torch path and ours): a peft adapter there would never run
    # nor train (the old code accepted it: the logits equalled the base model's)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_next", **{**TINY, "layer_types": ["linear_attention", "full_attention"],
                         "mlp_only_layers": [0, 1], "linear_num_key_heads": 2,
                         "linear_num_value_heads": 4, "linear_key_head_dim": 8,
                         "linear_value_head_dim": 8})
    model = AutoModelForCausalLM.from_config(config)
    # rank 64: peft adapts a depthwise conv only with a rank divisible by its groups
    with pytest.raises(ValueError, match=r"linear_attn.conv1d'\] would never run"):
        inject_lora(model, peft_config(_config(lora_rank=64, lora_targets="conv1d")))
    model = AutoModelForCausalLM.from_config(config)  # all-linear adapts the rest, not the conv
    modules = inject_lora(model, peft_config(_config(lora_rank=4)))
    assert "model.layers.0.linear_attn.in_proj_qkvz" in modules
    assert not any("conv1d" in n for n in modules)


def test_without_bitsandbytes_lora_4bit_names_the_extra(tmp_path):
    tiny_model_dir(tmp_path / "model")
    tiny_dataset_dir(tmp_path / "data", seq_length=16, rows=4)
    script = ("import sys; sys.modules['bitsandbytes'] = None\n"
              "from easy_context.cli import main; sys.exit(main(sys.argv[1:]))")
    run = subprocess.run([sys.executable, "-c", script, "train", "--model", str(tmp_path / "model"),
                          "--dataset", str(tmp_path / "data"), "--seq-length", "16",
                          "--lora-rank", "4", "--lora-4bit", "--output-dir", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "pip install 'easy-context[qlora]'" in run.stderr, run.stderr


def test_nf4_linear_computes_with_its_dequantized_weight_and_quantizes_the_decoder_linears():
    pytest.importorskip("bitsandbytes")
    from easy_context.train.qlora import NF4Linear, quantized_linears

    torch.manual_seed(0)
    weight, bias = torch.randn(24, 40), torch.nn.Parameter(torch.randn(24), requires_grad=False)
    layer = NF4Linear(40, 24, bias)
    layer.quantize_(weight)
    deq = layer.dequantize()
    assert layer.packed.numel() == 24 * 40 // 2  # two weights a byte
    assert 0 < (deq - weight).abs().max() < 0.5 * weight.abs().max()  # 4 bits: close, not equal
    x = torch.randn(2, 5, 40, requires_grad=True)
    y = layer(x)
    torch.testing.assert_close(y, x @ deq.T + bias, rtol=1e-5, atol=1e-5)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.ones(2, 5, 24) @ deq, rtol=1e-5, atol=1e-5)
    assert list(layer.parameters()) == [bias]  # the 4-bit weight is not a parameter
    # read as a linear layer's weight (Mamba-2 hands out_proj.weight to its fused kernel):
    # the weight it computes with (it had none: AttributeError in Granite 4 hybrids' forward)
    torch.testing.assert_close(layer.weight, deq, rtol=0, atol=0)
    model, _ = _lora_model(targets="q_proj")
    names = quantized_linears(model)
    assert "model.layers.0.self_attn.q_proj.base_layer" in names  # an adapter's base
    assert "model.layers.0.mlp.down_proj" in names  # a linear layer without an adapter
    assert not any(".lora_" in n for n in names) and "lm_head" not in names
    with pytest.raises(ValueError, match="weight of shape"):
        layer.quantize_(weight.T)


# bitsandbytes (0.50) has two CPU branches a QLoRA user can meet, chosen by the CPU, not by
# ATEN_CPU_CAPABILITY: (1) with its native library, 4-bit dequantization is its C kernel,
# without it the same formula in torch ops; (2) on CPUs with AVX-512 BF16
# (has_avx512bf16(): Sapphire Rapids and later), transformers' Linear4bit in eval mode
# without grad repacks its weight for a bf16 kernel. NF4Linear (training, and any forward of
# ours) never repacks: it hands bitsandbytes the plain quant state, so it dequantizes to
# the input's dtype on every CPU.

@pytest.mark.parametrize("shape", [(24, 40), (64, 128), (33, 37)])  # below one block, whole blocks, odd
def test_nf4_linear_computes_in_the_input_dtype_on_either_bitsandbytes_cpu_branch(shape):
    pytest.importorskip("bitsandbytes")
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    from easy_context.train.qlora import BLOCK, NF4Linear

    out_f, in_f = shape
    torch.manual_seed(0)
    weight = torch.randn(out_f, in_f)
    layer = NF4Linear(in_f, out_f, None)
    layer.quantize_(weight)
    state = layer.quant_state
    # (1) the native kernel and the torch-ops formula give the same weights, bit for bit
    torch_ops = _dequantize_4bit_compute(layer.packed.view(torch.uint8).reshape(-1), state.absmax,
                                         _get_4bit_code("nf4", layer.packed.device), BLOCK,
                                         state.shape, torch.float32)
    assert torch.equal(layer.dequantize(), torch_ops)
    # (2) eval mode without grad (where Linear4bit would repack on such a CPU) stays on the
    # fp32 path: matmul_4bit takes the bf16 kernel only for a quant state marked repacked
    x = torch.randn(2, 5, in_f)
    with torch.no_grad():
        y = layer.eval()(x)
    assert not getattr(layer.quant_state, "packing_format_for_cpu", False)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, x @ torch_ops.T, rtol=1e-5, atol=1e-5)


def test_transformers_4bit_eval_path_on_an_avx512_bf16_cpu():
    """Where the CPU has AVX-512 BF16, transformers' Linear4bit in eval mode computes in bf16
    on a repacked weight: within bf16 precision of NF4Linear (measured here, 4 seeds: 3.0e-3
    to 4.7e-3 of the largest output; tolerance 2e-2), and only for in_features a multiple of
    64 (what our merged-export test's tiny model does not have: it compares in train mode)."""
    bnb = pytest.importorskip("bitsandbytes")
    if not bnb.functional.has_avx512bf16():
        pytest.skip("this CPU has no AVX-512 BF16: bitsandbytes never repacks here")
    from easy_context.train.qlora import BLOCK, NF4Linear

    def linear4bit(weight):
        out_f, in_f = weight.shape
        lin = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.float32,
                                quant_type="nf4", compress_statistics=False)
        lin.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, quant_type="nf4",
                                       blocksize=BLOCK, compress_statistics=False)._quantize("cpu")
        return lin.eval()

    torch.manual_seed(0)
    weight, x = torch.randn(64, 128) * 0.05, torch.randn(3, 5, 128)
    ours = NF4Linear(128, 64, None)
    ours.quantize_(weight)
    lin = linear4bit(weight)
    with torch.no_grad():
        got, want = lin(x), ours(x)
    assert lin.weight.quant_state.packing_format_for_cpu  # the bf16 branch ran
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert 0 < err <= 2e-2, err
    with torch.no_grad(), pytest.raises(RuntimeError):
        linear4bit(torch.randn(32, 32))(torch.randn(2, 32))  # in_features below one block
