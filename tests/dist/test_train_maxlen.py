"""``easy-context train`` in max-length mode trains exactly like the untiled trainer (fp32, 2
gloo ranks): forced tiles and head chunks with each kind of checkpointing, the nested
recompute, FSDP and DeepSpeed ZeRO-3, and --auto-memory. Same tolerance as tests/dist/test_train.py:
the first step's loss within 1e-6 relative, later steps 1e-4 (AdamW amplifies rounding)."""

import pytest

from tests.train_fixtures import tiny_dataset_dir, tiny_model_dir

from .train_cases import train_error, train_run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("train_maxlen")
    tiny_model_dir(work / "model")
    tiny_model_dir(work / "model4", num_hidden_layers=5)  # for the nested recompute
    tiny_model_dir(work / "olmo2", family="olmo2")  # post-norm layers: not fused
    tiny_dataset_dir(work / "data", seq_length=32, rows=16)
    return str(work)


@pytest.fixture(scope="module")
def untiled(dist2, workdir):
    return dist2.run(train_run, workdir, "untiled", parallel_mode="zigzag_ring_attn",
                     mlp_tile="off", head_chunk="off")[0]


def _same(got, want):
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


def test_auto_memory_trains_the_same(dist2, workdir, untiled):
    # every setup the planner may pick is exact, so the trajectory is the untiled one
    metrics = dist2.run(train_run, workdir, "auto", auto_memory=True)[0]
    _same(metrics, untiled)


def test_bad_tiling_flags(dist2, workdir):
    assert "--mlp-tile must be auto, off or a number" in dist2.run(
        train_error, workdir, mlp_tile="big")[0]
    assert "--keep-every needs max-length mode" in dist2.run(
        train_error, workdir, mlp_tile="off", head_chunk="off", keep_every=2)[0]


def test_unsupported_layers_train_untiled_unless_forced(dist2, workdir):
    olmo = f"{workdir}/olmo2"
    metrics = dist2.run(train_run, workdir, "olmo_auto", model=olmo, max_train_steps=1)[0]
    assert len(metrics) == 1  # auto: the planner's choice falls back to the untiled layers
    assert "pre-norm decoder layers" in dist2.run(train_error, workdir, model=olmo,
                                                   mlp_tile="5")[0]
