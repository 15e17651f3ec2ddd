"""``easy-context train`` in max-length mode trains exactly like the untiled trainer (fp32, 2
gloo ranks): forced tiles and head chunks with each kind of checkpointing, the nested
recompute, FSDP and DeepSpeed ZeRO-3, and --auto-memory. Same tolerance as tests/dist/test_train.py:
the first step's loss within 1e-6 relative, later steps 1e-4 (AdamW amplifies rounding), the
first step's gradient norm within 1e-5."""

from pathlib import Path

import pytest

from tests.train_fixtures import tiny_dataset_dir, tiny_model_dir

from .train_cases import train_error, train_run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("train_maxlen")
    tiny_model_dir(work / "model")
    tiny_model_dir(work / "model4", num_hidden_layers=5)  # for the nested recompute
    tiny_model_dir(work / "olmo2", family="olmo2")  # post-norm layers: the generic path
    # residual dropout: refused by both paths (the generic path's recompute would draw again)
    tiny_model_dir(work / "phi3", family="phi3", pad_token_id=0, resid_pdrop=0.1)
    tiny_dataset_dir(work / "data", seq_length=32, rows=16)
    tiny_dataset_dir(work / "data4k", seq_length=4096, rows=4)
    return str(work)


@pytest.fixture(scope="module")
def untiled(dist2, workdir):
    return dist2.run(train_run, workdir, "untiled", parallel_mode="zigzag_ring_attn",
                     mlp_tile="off", head_chunk="off")[0]


def _same(got, want):
    # the first step's gradient norm: AdamW's first update hardly depends on the gradients'
    # size, so a wrong gradient can leave the second loss within tolerance; its norm cannot
    norms = [m["grad_norm"] for m in got], [m["grad_norm"] for m in want]
    assert abs(norms[0][0] - norms[1][0]) <= 1e-5 * norms[1][0], norms
    got, want = [m["loss"] for m in got], [m["loss"] for m in want]
    assert len(got) == len(want)
    assert abs(got[0] - want[0]) <= 1e-6 * abs(want[0]), (got, want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-4 * abs(w), (got, want)


@pytest.mark.parametrize("method,checkpointing,chunk", [
    ("zigzag_ring_attn", "full", "1"), ("zigzag_ring_attn", "offload", "2"),
    ("ulysses_attn", "attention", "2")])
def test_forced_tiles_equal_untiled(dist2, workdir, untiled, method, checkpointing, chunk):
    # 4 query / 2 KV heads: chunks of one KV head (2 query heads) or half of one (1)
    metrics = dist2.run(train_run, workdir, f"tiled_{method}_{checkpointing}",
                        parallel_mode=method, checkpointing=checkpointing, mlp_tile="5",
                        head_chunk=chunk)[0]
    _same(metrics, untiled)


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_nested_recompute_equals_untiled(dist2, workdir, engine):
    # 5 layers, one input in 2 kept: layers 1 and 3 are regenerated from 0 and 2 in backward,
    # with their weights gathered outside their own forward (FSDP2 unshard, ZeRO-3 gather)
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    model = f"{workdir}/model4"
    want = dist2.run(train_run, workdir, f"untiled4_{engine}", model=model, engine=engine,
                     mlp_tile="off", head_chunk="off")[0]
    got = dist2.run(train_run, workdir, f"nested_{engine}", model=model, engine=engine,
                    mlp_tile="5", head_chunk="1", keep_every=2, checkpointing="offload")[0]
    _same(got, want)


def test_deepspeed_tiled_equals_untiled(dist2, workdir, untiled):
    pytest.importorskip("deepspeed")
    metrics = dist2.run(train_run, workdir, "tiled_ds", parallel_mode="zigzag_ring_attn",
                        engine="deepspeed", mlp_tile="5", head_chunk="1")[0]
    _same(metrics, untiled)


def _auto_setups(model: str, seq_len: int) -> list[tuple[float, dict]]:
    """(budget GiB, the flags it resolves to) for every setup --auto-memory picks on 2 CPU ranks
    as its budget shrinks, from the planner's own estimates: each budget halfway between the
    estimate of the setup it picks and that of the one picked before (which no longer fits)."""
    import torch

    from easy_context.plan.auto import plan_for_length
    from easy_context.plan.shapes import load_shape
    from easy_context.train.memory_mode import GIB, _setups_here

    shape = load_shape(model)
    bases = _setups_here(shape, 2, torch.device("cpu"))
    picks, budget = [], 1 << 40
    while (plan := plan_for_length(shape, seq_len, 2, budget, None, "fp32", bases=bases)).setup:
        s = plan.setup
        picks.append((plan.estimate.total, {
            "parallel_mode": "data_parallel" if s.method == "local" else s.method,
            "engine": s.engine, "checkpointing": s.checkpointing,
            "mlp_tile": str(s.mlp_tile) if s.fused else "off",
            "head_chunk": str(s.heads_per_chunk) if s.fused else "off", "keep_every": s.keep_every}))
        budget = plan.estimate.total - 1
    highs = [picks[0][0] * 1.01] + [est for est, _ in picks[:-1]]
    return [((est + high) / 2 / GIB, flags) for (est, flags), high in zip(picks, highs)]


def test_auto_memory_picks_each_setup_and_trains_the_same(dist2, workdir):
    """--auto-memory-budget at 4096 tokens (2048 a rank): each smaller budget makes the planner
    pick another setup (untiled, then MLP tiles of 2048 down to 512 tokens and head chunks of 4
    down to 1 query head, with ulysses and ring, attention-saving and full checkpointing); each
    run trains with the setup picked, and every one like untiled zigzag."""
    import yaml

    model = f"{workdir}/model"
    setups = _auto_setups(model, 4096)
    tiled = [flags for _, flags in setups if flags["mlp_tile"] != "off"]
    assert len(setups) >= 4 and len(tiled) >= 3, setups
    # several tiles a rank and several head groups among them, or tiling is not exercised
    assert any(int(f["mlp_tile"]) < 2048 for f in tiled), setups
    assert any(f["head_chunk"] in ("1", "2") for f in tiled), setups
    data, common = f"{workdir}/data4k", dict(seq_length=4096, max_train_steps=2)
    want = dist2.run(train_run, workdir, "auto_ref", dataset=data, mlp_tile="off",
                     head_chunk="off", **common)[0]
    for i, (gib, flags) in enumerate(setups):
        got = dist2.run(train_run, workdir, f"auto{i}", dataset=data, auto_memory=True,
                        auto_memory_budget=gib, **common)[0]
        _same(got, want)
        used = yaml.safe_load((Path(workdir) / f"auto{i}" / "train_config.yaml").read_text())
        assert {k: used[k] for k in flags} == flags, (gib, used)
    assert "nothing fits" in dist2.run(train_error, workdir, dataset=data, auto_memory=True,
                                       auto_memory_budget=setups[-1][0] * 0.99, **common)[0]


def test_bad_tiling_flags(dist2, workdir):
    assert "--mlp-tile must be auto, off or a number" in dist2.run(
        train_error, workdir, mlp_tile="big")[0]
    assert "--keep-every needs max-length mode" in dist2.run(
        train_error, workdir, mlp_tile="off", head_chunk="off", keep_every=2)[0]


def test_unsupported_layers_train_untiled_unless_forced(dist2, workdir):
    phi3 = f"{workdir}/phi3"
    metrics = dist2.run(train_run, workdir, "phi3_auto", model=phi3, max_train_steps=1)[0]
    assert len(metrics) == 1  # auto: the planner's choice falls back to the untiled layers
    assert "dropout" in dist2.run(train_error, workdir, model=phi3, mlp_tile="5")[0]


@pytest.mark.parametrize("lora", [False, True])
def test_generic_path_trains_like_untiled(dist2, workdir, lora):
    """OLMo-2's post-norm layers (which the fused layer refuses) and LoRA adapters on every
    linear layer of Llama run on max-length mode's generic path: forced tiles and one query
    head per chunk, inputs offloaded, train like the untiled layers. OLMo-2 keeps one layer
    input in two: the other is regenerated with its weights gathered outside its forward
    (FSDP2's unshard)."""
    engine = "fsdp"
    kw = dict(lora_rank=4) if lora else dict(model=f"{workdir}/olmo2")
    nested = dict(keep_every=2) if not lora else {}
    name = f"{'lora' if lora else 'olmo'}_{engine}"
    want = dist2.run(train_run, workdir, f"{name}_untiled", parallel_mode="zigzag_ring_attn",
                     engine=engine, mlp_tile="off", head_chunk="off", **kw)[0]
    got = dist2.run(train_run, workdir, f"{name}_generic", parallel_mode="zigzag_ring_attn",
                    engine=engine, mlp_tile="5", head_chunk="1", checkpointing="offload",
                    **kw, **nested)[0]
    _same(got, want)


def test_generic_path_trains_under_zero3_like_untiled(dist2, workdir):
    """OLMo-2 on the generic path under DeepSpeed ZeRO-3 (refused before: the layer's
    attention found no _kernel_funcs, since zero.Init stopped undoing kernels' per-instance
    wrappers) trains like its untiled layers under ZeRO-3."""
    pytest.importorskip("deepspeed")
    kw = dict(model=f"{workdir}/olmo2", engine="deepspeed", parallel_mode="zigzag_ring_attn")
    want = dist2.run(train_run, workdir, "olmo_ds_untiled", mlp_tile="off", head_chunk="off",
                     **kw)[0]
    got = dist2.run(train_run, workdir, "olmo_ds_generic", mlp_tile="5", head_chunk="1",
                    checkpointing="offload", **kw)[0]
    _same(got, want)
