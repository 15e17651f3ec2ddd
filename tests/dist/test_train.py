"""``easy-context train`` end to end on a tiny Llama, fp32, on 1, 2 and 4 gloo ranks.

Parity: a sequence-parallel run sees the same samples as one process, and its loss is the
exact global token mean, so the loss trajectory equals the one-process run: the first step
within 1e-6 relative, later steps within 1e-4 (AdamW turns float rounding in the reduction
order into small weight differences). Data-parallel ranks split a global batch: 2 ranks x
batch 1 equal 1 rank x batch 2.
"""

import sys
from pathlib import Path

import pytest
import torch

from tests.train_fixtures import kill_and_resume, tiny_dataset_dir, tiny_hybrid_dir, tiny_model_dir

from .train_cases import strict_train_run, train_error, train_run

METHODS = ["ring_attn", "zigzag_ring_attn", "dist_flash_attn", "ulysses_attn", "usp_attn",
           "allgather_attn"]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("train")
    tiny_model_dir(work / "model")
    tiny_dataset_dir(work / "data", seq_length=32, rows=16)
    tiny_dataset_dir(work / "packed", seq_length=32, rows=16, packed=True)
    return str(work)


@pytest.fixture(scope="module")
def reference(dist1, workdir):
    """One process, batch 1 and batch 2, plain and packed data."""
    return {
        "b1": dist1.run(train_run, workdir, "ref_b1")[0],
        "b2": dist1.run(train_run, workdir, "ref_b2", batch_size=2)[0],
        "packed": dist1.run(train_run, workdir, "ref_packed", dataset=f"{workdir}/packed")[0],
    }


def _losses(metrics):
    return [m["loss"] for m in metrics]


def _assert_same_trajectory(got, want):
    assert len(got) == len(want)
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0]), (got, want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-4 * abs(w), (got, want)


def test_loss_decreases(reference):
    losses = _losses(reference["b1"])
    assert losses[-1] < losses[0], losses


def test_metrics_hold_the_rank_peak_memory(reference):
    # The rank's peak resident memory (a process holding torch and a model: hundreds of MB),
    # not the rise above the step's start that the log once printed as "-0 MB" on CPU.
    assert all(m["peak_memory_mb"] > 100 for m in reference["b1"])


@pytest.mark.parametrize("method", METHODS)
def test_sequence_parallel_equals_one_process(dist2, workdir, reference, method):
    extra = {"ring_degree": 1} if method == "usp_attn" else {}
    metrics = dist2.run(train_run, workdir, f"sp_{method}", parallel_mode=method, **extra)[0]
    _assert_same_trajectory(_losses(metrics), _losses(reference["b1"]))


def test_packed_documents_equal_one_process(dist2, workdir, reference):
    metrics = dist2.run(train_run, workdir, "sp_packed", dataset=f"{workdir}/packed",
                        parallel_mode="zigzag_ring_attn")[0]
    _assert_same_trajectory(_losses(metrics), _losses(reference["packed"]))


def test_data_parallel_equals_bigger_batch(dist2, workdir, reference):
    metrics = dist2.run(train_run, workdir, "dp", parallel_mode="data_parallel")[0]
    _assert_same_trajectory(_losses(metrics), _losses(reference["b2"]))


def test_dp_x_sp_on_4_ranks(dist4, workdir, reference):
    metrics = dist4.run(train_run, workdir, "dpxsp", parallel_mode="zigzag_ring_attn", sp_size=2)[0]
    _assert_same_trajectory(_losses(metrics), _losses(reference["b2"]))


def test_checkpointing_kinds_do_not_change_the_loss(dist2, workdir, reference):
    for kind in ("none", "offload", "attention"):
        metrics = dist2.run(train_run, workdir, f"ckpt_{kind}", checkpointing=kind)[0]
        _assert_same_trajectory(_losses(metrics), _losses(reference["b1"]))


def test_export_loads_and_holds_only_safetensors(reference, workdir):
    from transformers import AutoModelForCausalLM

    folder = Path(workdir) / "ref_b1" / "final_model"
    weights = sorted(p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
    assert weights == ["model.safetensors"]
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert model.config.num_hidden_layers == 2
    # the exported weights are the trained ones, not the initial ones
    init = AutoModelForCausalLM.from_pretrained(Path(workdir) / "model")
    assert not torch.equal(model.lm_head.weight, init.lm_head.weight)


def test_bf16_mixed_precision_trains(dist2, workdir):
    losses = _losses(dist2.run(train_run, workdir, "bf16", mixed_precision="bf16",
                               max_train_steps=4)[0])
    assert all(l == l for l in losses) and losses[-1] < losses[0], losses


@pytest.mark.parametrize("overrides, message", [
    ({"seq_length": 30}, "not divisible by 4"),
    ({"sp_size": 3}, "not divisible by --sp-size 3"),
    ({"dataset": "/nonexistent/data"}, "not found"),
    ({"model": "/nonexistent/model"}, "does not exist"),
    ({"seq_length": 64}, "needs 65"),
])
def test_bad_inputs_give_clear_errors(dist2, workdir, overrides, message):
    for error in dist2.run(train_error, workdir, **overrides):
        assert message in error, error


def test_dataset_without_input_ids(dist1, workdir, tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(tmp_path / "text"))
    error = dist1.run(train_error, workdir, dataset=str(tmp_path / "text"))[0]
    assert "no 'input_ids' column" in error


def test_nan_loss_stops_with_a_checkpoint(dist1, workdir):
    error = dist1.run(train_error, workdir, learning_rate=1e30, max_train_steps=5)[0]
    assert "NonFiniteLoss" in error and "checkpoint of step" in error
    assert (Path(workdir) / "bad" / "checkpoints" / "latest").exists()


@pytest.mark.slow
def test_killed_run_resumes_exactly(dist2, workdir, tmp_path):
    """SIGKILL a 2-rank run after a checkpoint, resume it, and compare the whole loss
    trajectory with an uninterrupted run of the same length: bit for bit."""
    out = tmp_path / "killed"
    args = [sys.executable, "-m", "easy_context.cli", "train", "--model", f"{workdir}/model",
            "--dataset", f"{workdir}/data", "--seq-length", "32", "--learning-rate", "1e-3",
            "--mixed-precision", "fp32", "--checkpointing", "full", "--seed", "7",
            "--nproc-per-node", "2", "--output-dir", str(out), "--save-every", "1",
            "--deterministic"]
    got, total = kill_and_resume(args, out)
    want = _losses(dist2.run(train_run, workdir, "uninterrupted", max_train_steps=total,
                             save_every=1, deterministic=True)[0])
    assert len(got) == total
    # Bitwise: with --deterministic (on GPUs it takes that; CPU kernels are deterministic).
    assert got == want


STRICT = [dict(offload="none"), dict(offload="params"),
          dict(offload="params", checkpointing="offload", lora_rank=4),
          dict(engine="deepspeed", offload="optimizer"), dict(engine="deepspeed", offload="params")]


@pytest.mark.parametrize("setup", STRICT, ids=lambda s: "-".join(map(str, s.values())))
def test_every_collective_suits_its_group_with_each_offload_setting(dist2, workdir, reference,
                                                                      setup):
    """Every collective of a 2-rank run (loading, steps with gradient clipping, checkpoint,
    export) has its tensors on a device type its group has a backend for: on GPUs that is
    what keeps NCCL from raising (launch.backend_for). The check is live (it counted the
    run's collectives); on this CPU host and device are one type, so benchmarks/gpu_check.py
    runs the same over CUDA. The loss is the one-process run's whatever the offload."""
    if setup.get("engine") == "deepspeed":
        pytest.importorskip("deepspeed")
    if "lora_rank" in setup:
        pytest.importorskip("peft")
    name = "strict_" + "_".join(map(str, setup.values()))
    got = dist2.run(strict_train_run, workdir, name, grad_clip=1.0, save_every=2, **setup)
    assert sum(got[0]["counts"].values()) > 0 and sum(got[1]["counts"].values()) > 0
    if "lora_rank" not in setup:
        _assert_same_trajectory(_losses(got[0]["metrics"]), _losses(reference["b1"]))


@pytest.mark.parametrize("family,config", [
    ("gemma2", dict(sliding_window=5, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                    query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"])),
    ("gpt_oss", dict(sliding_window=3, layer_types=["sliding_attention", "full_attention"],
                     num_local_experts=4, num_experts_per_tok=2))])
def test_attention_variant_models_train_alike_on_two_ranks(dist1, dist2, workdir, tmp_path,
                                                           family, config):
    """Soft-capped and sliding layers (Gemma 2), sliding layers with sinks (GPT-OSS): the
    trainer with LoRA on 2 ranks follows one process (the model's own attention against ours
    is tests/unit/test_attention_variants.py)."""
    tiny_model_dir(tmp_path / "model", family=family, **config)
    kw = dict(model=str(tmp_path / "model"), lora_rank=4)
    ref = dist1.run(train_run, workdir, f"ref_{family}", **kw)[0]
    got = dist2.run(train_run, workdir, f"sp_{family}", parallel_mode="zigzag_ring_attn", **kw)[0]
    _assert_same_trajectory(_losses(got), _losses(ref))
    assert len(set(_losses(ref))) == len(ref)  # the steps changed the weights (or the data)


@pytest.mark.parametrize("family,options", [
    ("qwen3_next", {}), ("granite_hybrid", dict(chunked_loss=False)),
    ("lfm2", dict(lora_rank=4, checkpointing="attention"))])
def test_hybrid_models_train_alike_on_two_ranks(dist1, dist2, workdir, tmp_path, family, options):
    """Hybrids (gated DeltaNet, Mamba-2, short convolutions beside attention): the trainer on 2
    ranks follows one process, with the chunked loss or the logits' one, LoRA on every linear
    layer (the recurrent layers' projections too), checkpointing kinds."""
    if "lora_rank" in options:
        pytest.importorskip("peft")
    kw = dict(model=str(tiny_hybrid_dir(tmp_path / "model", family)), **options)
    ref = dist1.run(train_run, workdir, f"ref_{family}", **kw)[0]
    got = dist2.run(train_run, workdir, f"sp_{family}", parallel_mode="zigzag_ring_attn", **kw)[0]
    _assert_same_trajectory(_losses(got), _losses(ref))
    assert len(set(_losses(ref))) == len(ref)  # the steps changed the weights (or the data)
