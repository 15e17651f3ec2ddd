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
    # max-length mode's fused layers compute with the base weights: forcing it under LoRA
    # would skip the adapters, so it is refused (its "auto" default stays off instead)
    ({"lora_rank": 4, "mlp_tile": "512"}, "--mlp-tile: max-length mode does not run LoRA"),
    ({"lora_rank": 4, "head_chunk": "2", "keep_every": 2}, "--head-chunk, --keep-every: max"),
    ({"lora_rank": 4, "auto_memory": True}, "--auto-memory: max-length mode does not run LoRA"),
])
def test_flags_are_checked(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw).validate()


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
    model, _ = _lora_model(targets="q_proj")
    names = quantized_linears(model)
    assert "model.layers.0.self_attn.q_proj.base_layer" in names  # an adapter's base
    assert "model.layers.0.mlp.down_proj" in names  # a linear layer without an adapter
    assert not any(".lora_" in n for n in names) and "lm_head" not in names
    with pytest.raises(ValueError, match="weight of shape"):
        layer.quantize_(weight.T)
