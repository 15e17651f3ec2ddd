"""The DeepSpeed ZeRO-3 engine trains exactly like the FSDP engine, on 2 gloo ranks.

Same tiny llama, same data, zigzag_ring_attn over both ranks, fp32, full activation
checkpointing: the per-step losses (and gradient norms) of --engine deepspeed equal those of
--engine fsdp, with and without optimizer offload, with gradient accumulation, and across a
checkpoint + resume. The exported model loads with from_pretrained and equals FSDP's export.
Hybrid models (Qwen3-Next; Granite 4 with LoRA) follow FSDP in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("deepspeed")

from tests.train_fixtures import tiny_dataset_dir, tiny_hybrid_dir, tiny_model_dir  # noqa: E402

SEQ = 64


def ds_train(workdir: str, name: str, **overrides) -> list[dict]:
    """Rank function: train the tiny model; rank 0 returns its per-step metrics."""
    import torch.distributed as dist

    from easy_context.train.config import TrainConfig
    from easy_context.train.trainer import results_of, run_training

    work = Path(workdir)
    values = dict(model=str(work / "model"), dataset=str(work / "data"), seq_length=SEQ,
                  max_train_steps=3, learning_rate=1e-3, output_dir=str(work / name),
                  mixed_precision="fp32", checkpointing="full", seed=7,
                  parallel_mode="zigzag_ring_attn")
    values.update(overrides)
    config = TrainConfig(**values)
    config.validate()
    run_training(config)
    dist.barrier()
    return results_of(config.output_dir) if dist.get_rank() == 0 else []


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    work = tmp_path_factory.mktemp("ds_train")
    tiny_model_dir(work / "model")
    tiny_dataset_dir(work / "data", SEQ, rows=16)
    return str(work)


def _assert_same_losses(got: list[dict], want: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for i, (g, w) in enumerate(zip(got, want)):
        tol = 1e-5 if i == 0 else 1e-4
        assert g["loss"] == pytest.approx(w["loss"], rel=tol), (i, got, want)
        assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-3), (i, got, want)


@pytest.fixture(scope="module")
def fsdp_reference(dist2, workdir) -> list[dict]:
    return dist2.run(ds_train, workdir, "fsdp", engine="fsdp")[0]


@pytest.mark.slow
def test_deepspeed_equals_fsdp_and_exports(dist2, workdir, fsdp_reference):
    got = dist2.run(ds_train, workdir, "ds", engine="deepspeed")[0]
    _assert_same_losses(got, fsdp_reference)
    assert got[-1]["loss"] < got[0]["loss"]

    import torch
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(Path(workdir) / "ds" / "final_model")
    ref = AutoModelForCausalLM.from_pretrained(Path(workdir) / "fsdp" / "final_model")
    assert {p.suffix for p in (Path(workdir) / "ds" / "final_model").iterdir()} <= {
        ".json", ".safetensors"}
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert ours_sd.keys() == ref_sd.keys()
    for key in ref_sd:
        assert ours_sd[key].dtype == torch.float32, key
        torch.testing.assert_close(ours_sd[key], ref_sd[key], rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.slow
def test_offload_optimizer_with_accumulation_and_resume(dist2, workdir):
    """--offload optimizer, 2 micro-batches per step: equals FSDP; a run stopped after step 2
    and resumed from its DeepSpeed checkpoint gives the same step 3."""
    accum = dict(gradient_accumulate_every=2)
    want = dist2.run(ds_train, workdir, "fsdp_acc", engine="fsdp", **accum)[0]
    got = dist2.run(ds_train, workdir, "ds_off", engine="deepspeed", offload="optimizer",
                    **accum)[0]
    _assert_same_losses(got, want)

    dist2.run(ds_train, workdir, "ds_resume", engine="deepspeed", offload="optimizer",
              max_train_steps=2, **accum)
    resumed = dist2.run(ds_train, workdir, "ds_resume", engine="deepspeed", offload="optimizer",
                        resume=True, **accum)[0]
    assert resumed[-1]["step"] == 3
    assert resumed[-1]["loss"] == pytest.approx(got[-1]["loss"], rel=1e-5)


@pytest.mark.parametrize("family,options", [
    ("qwen3_next", {}),
    pytest.param("granite_hybrid", dict(lora_rank=4), marks=pytest.mark.slow)])
def test_hybrid_models_equal_one_process(dist1, dist2, workdir, tmp_path, family, options):
    """Hybrids under ZeRO-3 (the old code failed to build them: transformers' weight init
    copied whole A_log tensors into zero.Init's empty partitions) on 2 ranks follow FSDP in
    one process; LoRA on the Mamba-2 layers' projections too."""
    if "lora_rank" in options:
        pytest.importorskip("peft")
    model = str(tiny_hybrid_dir(tmp_path / "model", family))
    ref = dist1.run(ds_train, workdir, f"ref_{family}", model=model, engine="fsdp", **options)[0]
    got = dist2.run(ds_train, workdir, f"ds_{family}", model=model, engine="deepspeed",
                    **options)[0]
    _assert_same_losses(got, ref)


DS_BUILD_TWICE = """
import os, sys
import torch
import torch.distributed as dist
from easy_context.train.config import TrainConfig
from easy_context.train.engines.deepspeed import zero_init
from easy_context.train.model import build_empty_model
from transformers import AutoConfig, AutoModelForCausalLM

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
config = TrainConfig(model=sys.argv[1], dataset="-", engine="deepspeed", mixed_precision="fp32")
build_empty_model(config, lambda mc: zero_init(config, mc, torch.device("cpu")),
                  buffers_outside=True)
# a model built afterwards in the same process (a second run, an evaluation)
later = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(sys.argv[1]))
print("KERNEL_FUNCS", sorted(later.model.layers[0].linear_attn.__dict__.get("_kernel_funcs", {})))
dist.destroy_process_group()
"""


def test_models_built_after_zero_init_keep_their_kernel_functions(tmp_path):
    """zero.Init puts back, on exit, the __init__ a module class had when it was made inside
    it: kernels' use_kernelized_func (which gives each recurrent layer its kernel functions)
    was undone when the modeling code was first imported inside zero.Init, and every model
    built later in the process was refused as unroutable. A fresh process: the import is
    the build's own."""
    import socket
    import subprocess
    import sys

    model = tiny_hybrid_dir(tmp_path / "model", "qwen3_next")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    run = subprocess.run([sys.executable, "-c", DS_BUILD_TWICE, str(model), port],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "KERNEL_FUNCS ['causal_conv1d_fn'" in run.stdout and "chunk_gated_delta_rule" in \
        run.stdout, run.stdout[-2000:]
