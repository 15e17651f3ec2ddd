"""``easy-context train`` as a user runs it, measured from outside: for the planner's validation
(plan_validation.py --trainer) and the max-length benchmark (maxlen.py).

Each run is two optimizer steps (the second one steady-state: AdamW's states exist) of ``python -m easy_context.train`` (the ``easy-context train``
entry point) on a tiny model with Llama-3-8B's proportions (hidden 256, intermediate 3.5x,
4 layers, 8 query / 2 KV heads, vocabulary 32000) or its Qwen2 twin (q/k/v biases), fp32,
FSDP, one random sequence of L tokens, no export. Its ranks' resident high-water marks
(VmHWM) are read from /proc by benchmarks/common.py:watch_ranks while it runs; nothing in
the environment is set for it (the trainer sets its allocator up itself), unless a run asks
for glibc's default allocator (``allocator="glibc"``: a harmless MALLOC_TOP_PAD_ equal to
glibc's default tells the trainer the user chose their own settings, so it leaves them).

    python benchmarks/trainer_runs.py --probe 2   # the resident size of a rank before its model
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

SHAPE = dict(vocab_size=32000, hidden_size=256, intermediate_size=896, num_hidden_layers=4,
             num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=131072,
             attention_dropout=0.0, tie_word_embeddings=False)
MODELS = {
    "llama3-tiny": dict(family="llama", attention_bias=False),
    "qwen2-tiny": dict(family="qwen2", use_sliding_window=False),
    # Gemma 3's layer (sandwich norms, q/k norms, a query scale of its own, GELU-tanh MLP of
    # 4x the width as in Gemma 3 4B) at the same width: three sliding-window layers of 1024
    # tokens, then a global one (its 5:1 pattern cut to 4 layers); soft-caps as the real
    # config has them (none: Gemma 3 dropped Gemma 2's for q/k norms). Runs the generic path.
    "gemma3-tiny": dict(family="gemma3_text", head_dim=32, query_pre_attn_scalar=32,
                        intermediate_size=1024, sliding_window=1024,
                        layer_types=["sliding_attention"] * 3 + ["full_attention"],
                        final_logit_softcapping=None, attn_logit_softcapping=None),
    # DeepSeek-V3's layer: multi-head latent attention (q LoRA rank 64, KV latent 32, a rope /
    # nope split of the query-key head of 16 + 32, a value head of 32 of its own), 8 heads
    # with their own K/V; the first layer dense (896), the others an MoE of 8 routed experts
    # (intermediate 128, 2 per token, sigmoid routing in 2 groups of which 1 is taken) and one
    # shared expert. Runs the generic path.
    "deepseek3-tiny": dict(family="deepseek_v3", num_key_value_heads=8, q_lora_rank=64,
                           kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=32,
                           v_head_dim=32, head_dim=16, n_routed_experts=8,
                           num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
                           n_group=2, topk_group=1, first_k_dense_replace=1),
}
# Two steps: the second is steady-state (AdamW's states exist from the first step's update)
STEPS = 2
WORK = Path(os.environ.get("EC_BENCH_WORK", Path(tempfile.gettempdir()) / "easy_context_bench"))
GLIBC_DEFAULT = {"MALLOC_TOP_PAD_": "131072"}  # glibc's own default: changes nothing but the trainer's choice


@dataclass(frozen=True)
class TrainRun:
    model: str
    world: int
    seq_len: int
    method: str = "zigzag_ring_attn"  # data_parallel on one rank
    checkpointing: str = "full"
    mlp_tile: int | None = None  # None: untiled (--mlp-tile off)
    head_chunk: int | None = None
    keep_every: int = 1
    allocator: str = "ours"  # ours | glibc
    engine: str = "fsdp"  # fsdp | deepspeed

    @property
    def fused(self) -> bool:
        return self.mlp_tile is not None or self.head_chunk is not None

    @property
    def key(self) -> str:
        mode = (f"tile={self.mlp_tile} chunk={self.head_chunk}" if self.fused else "untiled")
        keep = f" keep_every={self.keep_every}" if self.keep_every > 1 else ""
        alloc = " glibc-default-malloc" if self.allocator == "glibc" else ""
        alloc += f" engine={self.engine}" if self.engine != "fsdp" else ""
        method = "data_parallel" if self.world == 1 else self.method
        return (f"train {self.model} {method} N={self.world} L={self.seq_len} "
                f"ckpt={self.checkpointing} {mode}{keep}{alloc}")


def model_dir(name: str) -> Path:
    folder = WORK / name
    if not (folder / "config.json").exists():
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        kw = {**SHAPE, **MODELS[name]}
        config = AutoConfig.for_model(kw.pop("family"), **kw)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


def dataset_dir(seq_len: int) -> Path:
    folder = WORK / f"data_{seq_len}"
    if not (folder / "state.json").exists():
        import datasets
        import torch

        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(0, SHAPE["vocab_size"], (2, seq_len + 1), generator=gen)
        datasets.Dataset.from_dict({"input_ids": ids.tolist()}).save_to_disk(str(folder))
    return folder


def command(run: TrainRun, output: Path) -> list[str]:
    flags = ["--model", str(model_dir(run.model)), "--dataset", str(dataset_dir(run.seq_len)),
             "--seq-length", str(run.seq_len), "--nproc-per-node", str(run.world),
             "--parallel-mode", "data_parallel" if run.world == 1 else run.method,
             "--mixed-precision", "fp32", "--engine", run.engine, "--checkpointing", run.checkpointing,
             "--max-train-steps", str(STEPS), "--learning-rate", "1e-4", "--no-export",
             "--output-dir", str(output), "--mlp-tile", str(run.mlp_tile or "off"),
             "--head-chunk", str(run.head_chunk or "off"), "--keep-every", str(run.keep_every)]
    return [sys.executable, "-m", "easy_context.train", *flags]


def clean_env(extra: dict | None = None) -> dict:
    """The caller's environment without any MALLOC_* setting (a user's shell), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(extra or {})
    env.setdefault("PYTHONPATH", str(common.REPO))
    return env


def run_train(run: TrainRun, timeout_s: float = 3600.0) -> dict:
    """One step of ``easy-context train``; per-rank peaks (from outside), step time, loss."""
    WORK.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix="run_", dir=WORK))
    env = clean_env(GLIBC_DEFAULT if run.allocator == "glibc" else None)
    r = common.watch_ranks(command(run, out), env=env, timeout_s=timeout_s)
    row = {**asdict(run), "key": run.key, "ok": r["returncode"] == 0, "wall_s": r["wall_s"],
           "rank_peaks_bytes": r["rank_peaks_bytes"]}
    metrics = out / "metrics.jsonl"
    if row["ok"] and metrics.exists():
        last = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()][-1]
        row.update(step_s=last["step_time_s"], loss=last["loss"])
    else:
        row.update(ok=False, error=(r["stderr"] or r["stdout"])[-1500:])
    return row


def _probe_rank() -> int:
    """What a training rank holds before its model: imports, allocator, process group."""
    import datasets  # noqa: F401
    import torch.distributed as dist

    from easy_context.train import trainer  # noqa: F401 - the trainer's imports
    from easy_context.train.config import TrainConfig
    from easy_context.utils.allocator import configure_allocator

    configure_allocator("cpu")
    trainer._ensure_process_group(TrainConfig(model="x", dataset="x"))
    dist.barrier()
    return 0


def import_baseline(world: int) -> int:
    """The largest rank's VmHWM of a probe that does what a rank does before loading a model."""
    r = common.watch_ranks([sys.executable, __file__, "--probe", str(world)], env=clean_env())
    if r["returncode"]:
        raise RuntimeError(r["stderr"][-1500:])
    return r["rank_peaks_bytes"][0]


def shape(name: str):
    from easy_context.plan import ModelShape, load_shape

    if name not in ("llama3-tiny", "qwen2-tiny"):  # read from the model's config (its layer
        return load_shape(str(model_dir(name)))  # kinds and max-length paths)

    return ModelShape(name=name, hidden=SHAPE["hidden_size"], layers=SHAPE["num_hidden_layers"],
                      heads=SHAPE["num_attention_heads"], kv_heads=SHAPE["num_key_value_heads"],
                      intermediate=SHAPE["intermediate_size"], vocab=SHAPE["vocab_size"],
                      qkv_bias=name.startswith("qwen2"))


def predict(run: TrainRun):
    """The planner's estimate for ``run`` (on a CPU the host is the device: what is offloaded
    to it counts in the same resident memory)."""
    from easy_context.plan import estimate_memory

    est = estimate_memory(shape(run.model), run.seq_len, run.world,
                          "local" if run.world == 1 else run.method, engine="fsdp",
                          offload="none", checkpointing=run.checkpointing, dtype="fp32",
                          loss_chunk="auto", device="cpu",
                          mlp_tile=run.mlp_tile if run.fused else None,
                          heads_per_chunk=run.head_chunk if run.fused else None,
                          keep_every=run.keep_every)
    return est, est.total + est.host_bytes


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        from easy_context.launch import launch

        launch(_probe_rank, int(sys.argv[2]))
