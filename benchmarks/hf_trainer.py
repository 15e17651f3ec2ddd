"""TRL's SFTTrainer at long context on 2 CPU ranks: our integration against accelerate's own.

One script, the same for every system (``--worker``): TRL's SFTTrainer, launched by torchrun on
N gloo ranks, on the tiny model with Llama-3-8B's proportions that benchmarks/maxlen.py uses
(hidden 256, intermediate 896, 4 layers, 8 query / 2 KV heads, vocabulary 32000; fp32), one
pre-tokenized random sequence of L tokens per step, batch 1, no accumulation, AdamW, DeepSpeed
ZeRO-3 (the config `easy-context train` runs with, passed in SFTConfig), two optimizer steps (the second is the one timed: a
callback's wall time from step begin to step end, the slowest rank). Systems:

- ``ours-untiled``: ``enable_sequence_parallel(trainer, "zigzag_ring_attn", checkpointing="full")``;
- ``ours-maxlen``: the same with ``max_length=True, mlp_tile=1024, head_chunk=4`` (tiled MLP,
  one KV head per attention chunk, the loss tiled with the final norm);
- ``accelerate-ulysses``: no easy_context; ``SFTConfig(parallelism_config=ParallelismConfig(
  sp_backend="deepspeed", sp_size=N))``: accelerate's DeepSpeed Ulysses (ALST in transformers'
  Trainer: Ulysses all-to-alls around sdpa, DeepSpeed's sequence-sharding data loader, the
  loss from full logits of each shard), with transformers' ``gradient_checkpointing=True``;
- ``accelerate-cp``: no easy_context; ``ParallelismConfig(cp_size=N)``: torch's context
  parallelism (ring attention over sdpa). It needs FSDP2, so it gets an FSDP2 config instead
  of ZeRO-3; where it cannot run, its row records the error it stops with.

And for the step-time target, ``easy-context train`` on the same work (benchmarks/trainer_runs.py:
the same model, a random sequence of L tokens, zigzag, full checkpointing, fp32, DeepSpeed
ZeRO-3, two AdamW steps, the second's step time): ``ec-train-untiled`` and ``ec-train-maxlen``.

Per-rank peak memory is each rank's resident high-water mark read from /proc while it runs
(benchmarks/common.py watch_ranks), the same for every system; every SFTTrainer run starts with
MALLOC_MMAP_THRESHOLD_=65536 (benchmarks/common.py), ``easy-context train`` with nothing set
(it configures its allocator itself). At each length the systems run round-robin: each of
``--repeats`` rounds runs every system once, in an order that rotates from round to round; with
more than one round the first is dropped (warm-up) and each figure is the median of the rest,
with its spread (min, max). Growth = peak at L minus peak at the shortest length. The
Markdown table the docs quote goes to benchmarks/results/<output>.md.

    python benchmarks/hf_trainer.py                     # -> benchmarks/results/hf_trainer.json
    python benchmarks/hf_trainer.py --lengths 2048 --repeats 4 --output hf_trainer_2k_repeats
    python benchmarks/hf_trainer.py --lengths 2048 --systems ours-untiled accelerate-ulysses
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import os
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.trainer_runs import SHAPE, WORK, TrainRun, model_dir, run_train  # noqa: E402

MB = 2**20
MODEL = "llama3-tiny"
# What the figures measure: a results file older than the last change to these is stale.
MEASURES = ["easy_context/integrations", "easy_context/parallel", "easy_context/attention",
            "easy_context/memory", "easy_context/models.py", "easy_context/train",
            "easy_context/utils", "easy_context/launch.py"]
OURS = {
    "ours-untiled": dict(checkpointing="full"),
    "ours-maxlen": dict(max_length=True, mlp_tile=1024, head_chunk=4),
}
PEERS = ("accelerate-ulysses", "accelerate-cp")
EC_TRAIN = {
    "ec-train-untiled": dict(),
    "ec-train-maxlen": dict(mlp_tile=1024, head_chunk=4),
}
SYSTEMS = [*OURS, *PEERS, *EC_TRAIN]
# which easy-context train run does the same work as which integration run
SAME_WORK = {"ours-untiled": "ec-train-untiled", "ours-maxlen": "ec-train-maxlen"}
STEPS = 2


# --------------------------------------------------------------------------- one rank
def _tokenizer_dir() -> Path:
    """A word-level tokenizer over the model's 32000 ids (SFTTrainer wants a processing class;
    the data is already token ids, so its vocabulary only has to cover them)."""
    folder = WORK / "hf_trainer_tokenizer"
    if not (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        vocab = {f"t{i}": i for i in range(SHAPE["vocab_size"])}
        raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
        raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="t0", pad_token="t1",
                                      eos_token="t2")
        tok.save_pretrained(folder)
    return folder


def _deepspeed_config() -> dict:
    """The ZeRO-3 config ``easy-context train`` runs with (its default file, the offload
    sections dropped as its ``--offload none`` drops them): the same engine settings on both
    sides of the step-time comparison. Its "auto" entries the Trainer resolves as ours does
    (buckets from the hidden size, batch, accumulation and clipping from the arguments)."""
    from easy_context.train.engines.deepspeed import DEFAULT_CONFIG

    config = json.loads(DEFAULT_CONFIG.read_text())
    for key in ("offload_optimizer", "offload_param"):
        config["zero_optimization"].pop(key, None)
    return config


def worker(system: str, seq_len: int, out: Path) -> None:
    import datasets
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    world = int(os.environ["WORLD_SIZE"])
    extra: dict = {"deepspeed": _deepspeed_config()}
    if system in PEERS:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import DeepSpeedSequenceParallelConfig

        if system == "accelerate-ulysses":
            extra["parallelism_config"] = ParallelismConfig(
                sp_backend="deepspeed", sp_size=world,
                sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True,
                                                           sp_attn_implementation="sdpa"))
        else:  # torch context parallelism: FSDP2 only
            extra = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2},
                     "parallelism_config": ParallelismConfig(cp_size=world, cp_backend="torch")}

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self._t0)

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SHAPE["vocab_size"], (STEPS, seq_len), generator=gen)
    dataset = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    # the model before the config: built whole on every rank and sharded when the Trainer
    # starts DeepSpeed (a config made first turns on zero.Init inside from_pretrained, whose
    # batch-size check runs before the process group exists and fails); the same for all
    model = AutoModelForCausalLM.from_pretrained(str(model_dir(MODEL)), dtype=torch.float32,
                                                 attn_implementation="sdpa")
    config = SFTConfig(output_dir=str(out), max_length=seq_len, packing=False,
                       per_device_train_batch_size=1, gradient_accumulation_steps=1,
                       max_steps=STEPS, learning_rate=1e-4, optim="adamw_torch",
                       lr_scheduler_type="constant", gradient_checkpointing=True, bf16=False,
                       logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                       disable_tqdm=True, dataloader_num_workers=0, seed=0, **extra)
    if system == "accelerate-ulysses" and not torch.cuda.is_available():
        # accelerate registers Ulysses before it starts DeepSpeed, and DeepSpeed's own
        # communication layer is started by accelerate only on accelerators: on gloo ranks a
        # script has to start it (over the process group the Trainer's arguments made)
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    timer = StepTimer()
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset,
                         processing_class=AutoTokenizer.from_pretrained(str(_tokenizer_dir())),
                         callbacks=[timer])
    if system in OURS:
        from easy_context import enable_sequence_parallel

        enable_sequence_parallel(trainer, "zigzag_ring_attn", **OURS[system])
    trainer.train()
    # the slowest rank's time for each step
    times = torch.tensor(timer.times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        print("RESULT " + json.dumps({"step_s": times[-1].item(), "steps_s": times.tolist(),
                                      "loss": losses[-1] if losses else None}), flush=True)


# --------------------------------------------------------------------------- the driver
def _is_rank(argv: list[str]) -> bool:
    # torchrun's workers run this file with --worker; the launcher is the watched process itself
    return "--worker" in argv and not any("torch.distributed.run" in a for a in argv)


def run_hf(system: str, seq_len: int, world: int, timeout_s: float) -> dict:
    WORK.mkdir(parents=True, exist_ok=True)
    model_dir(MODEL)
    _tokenizer_dir()
    out = Path(tempfile.mkdtemp(prefix="hf_", dir=WORK))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world), str(Path(__file__).resolve()), "--worker", system, "--seq-len",
           str(seq_len), "--out", str(out)]
    env = common.bench_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), env.get("PYTHONPATH")) if p)
    r = common.watch_ranks(cmd, env=env, timeout_s=timeout_s, is_rank=_is_rank)
    row = {"system": system, "seq_len": seq_len, "world": world, "ok": r["returncode"] == 0,
           "wall_s": r["wall_s"], "rank_peaks_bytes": r["rank_peaks_bytes"][:world]}
    result = [line for line in r["stdout"].splitlines() if line.startswith("RESULT ")]
    if row["ok"] and result:
        row.update(json.loads(result[-1][len("RESULT "):]))
    else:
        row.update(ok=False, error=_first_error(r["stderr"] or r["stdout"]))
    return row


_EXCEPTION = re.compile(r"^\s*(\[rank\d+\]:\s*)?([\w.]+(Error|Exception)):\s")


def _first_error(text: str) -> str:
    """The exception a failed rank stopped with, and the tail of the output. torchrun's own
    ChildFailedError only says that a rank failed, so a rank's exception line comes first."""
    lines = text.splitlines()
    exc = [line.strip() for line in lines if _EXCEPTION.match(line) and "ChildFailedError" not in line]
    exc = exc or [line.strip() for line in lines if "Error" in line or "error:" in line]
    return (exc[0][:600] + "\n" if exc else "") + text[-1200:]


def run_ec(system: str, seq_len: int, world: int, timeout_s: float) -> dict:
    row = run_train(TrainRun(MODEL, world, seq_len, engine="deepspeed", **EC_TRAIN[system]),
                    timeout_s=timeout_s)
    return {**row, "system": system}


def _peak(row: dict) -> int:
    return max(row["rank_peaks_bytes"])


def _measured(rows: list[dict]) -> dict[tuple[str, int], dict]:
    """(system, L) -> median step time and peak over the measured rounds (all but the first
    when there are several), with their spread."""
    rounds = max((r.get("repeat", 0) for r in rows), default=0) + 1
    keep = [r for r in rows if r["ok"] and (rounds == 1 or r.get("repeat", 0) > 0)]
    out: dict[tuple[str, int], dict] = {}
    for key in sorted({(r["system"], r["seq_len"]) for r in keep}):
        mine = [r for r in keep if (r["system"], r["seq_len"]) == key]
        steps, peaks = [r["step_s"] for r in mine], [_peak(r) for r in mine]
        out[key] = {"step_s": statistics.median(steps), "step_s_min": min(steps),
                    "step_s_max": max(steps), "peak_bytes": statistics.median(peaks),
                    "peak_bytes_min": min(peaks), "peak_bytes_max": max(peaks),
                    "runs": len(mine), "loss": mine[0].get("loss")}
    return out


def summarise(rows: list[dict], lengths: list[int]) -> dict:
    ok = _measured(rows)
    growth = {}
    for (system, L), row in ok.items():
        if L != lengths[0] and (system, lengths[0]) in ok:
            growth.setdefault(system, {})[str(L)] = (row["peak_bytes"] - ok[(system, lengths[0])]["peak_bytes"]) / MB
    targets = []
    for L in lengths[1:]:
        for ours in OURS:
            for peer in PEERS:
                g, p = growth.get(ours, {}).get(str(L)), growth.get(peer, {}).get(str(L))
                if g is not None and p is not None:
                    targets.append({"target": f"{ours} peak growth {lengths[0]} -> {L} <= {peer}'s",
                                    "ours_mb": round(g, 1), "peer_mb": round(p, 1),
                                    "result": "PASS" if g <= p else "FAIL"})
    for L in lengths:
        for ours, ec in SAME_WORK.items():
            if (ours, L) in ok and (ec, L) in ok:
                ratio = ok[(ours, L)]["step_s"] / ok[(ec, L)]["step_s"]
                targets.append({"target": f"{ours} step time <= 1.1x {ec}'s at L={L}",
                                "ratio": round(ratio, 3), "result": "PASS" if ratio <= 1.1 else "FAIL"})
    failed = {r["system"]: r.get("error", "").splitlines()[0] if r.get("error") else "failed"
              for r in rows if not r["ok"]}
    measured = [{"system": s, "seq_len": L, **m} for (s, L), m in ok.items()]
    return {"measured": measured, "growth_mb": growth, "targets": targets, "did_not_run": failed}


def table(payload: dict) -> str:
    """The Markdown table docs/guides/trainer.md and the README quote, from a results file."""
    m = {(r["system"], r["seq_len"]): r for r in payload["measured"]}
    growth = payload["growth_mb"]
    lengths = sorted({L for _, L in m} | {r["seq_len"] for r in payload["rows"]})
    spread = any(r["runs"] > 1 for r in m.values())
    head = ["system", "L", "peak MB / rank", "growth MB", "step s", "vs easy-context train"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for system in SYSTEMS:
        for L in lengths:
            r = m.get((system, L))
            if r is None:
                if system in payload["did_not_run"]:
                    lines.append(f"| {system} | {L} | did not run | | | |")
                continue
            g = growth.get(system, {}).get(str(L))
            step = f"{r['step_s']:.2f}"
            if spread:
                step += f" ({r['step_s_min']:.2f}-{r['step_s_max']:.2f})"
            ec = m.get((SAME_WORK.get(system, ""), L))
            ratio = f"{r['step_s'] / ec['step_s']:.3f}x" if ec else ""
            lines.append(f"| {system} | {L} | {r['peak_bytes'] / MB:.0f} | "
                         f"{'' if g is None else f'{g:+.0f}'} | {step} | {ratio} |")
    runs = max(r["runs"] for r in m.values()) if m else 0
    note = (f"{payload['machine']['cpu_description']}; {payload['world']} gloo ranks, fp32, "
            f"commit {payload['machine']['git_commit']}, {payload['date'][:10]}; "
            + (f"median of {runs} rounds after a dropped first one (min-max)" if spread
               else "one run per system and length"))
    for system, error in payload["did_not_run"].items():
        note += f"; {system} did not run: {error.strip()}"
    return "\n".join(lines) + "\n\n" + note + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 16384, 32768])
    ap.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds per length; with more than one the first is dropped")
    ap.add_argument("--output", default="hf_trainer")
    ap.add_argument("--table-only", action="store_true",
                    help="recompute the summary (medians, growth, targets) and the Markdown "
                         "table from the rows of the results file, without running anything")
    a = ap.parse_args()
    if a.table_only:
        payload = json.loads(common.results_path(a.output).read_text())
        payload.update(summarise(payload["rows"], payload.get("lengths", sorted(
            {r["seq_len"] for r in payload["rows"]}))))
        common.write_results(a.output, payload)
        print(_write_table(a.output, payload))
        return
    t0 = time.perf_counter()
    machine = common.machine_info()
    rows = []
    turn = 0
    for L in a.lengths:
        for repeat in range(a.repeats):
            k = turn % len(a.systems)
            turn += 1
            for system in a.systems[k:] + a.systems[:k]:
                run = run_ec if system in EC_TRAIN else run_hf
                row = run(system, L, a.world, a.timeout_s)
                row["repeat"] = repeat
                row["load_average_after"] = common.load_average()
                rows.append(row)
                state = (f"peak {_peak(row) / MB:.0f} MB, step {row['step_s']:.1f} s" if row["ok"]
                         else "FAILED " + row.get("error", "").splitlines()[0][:300]
                         if row.get("error") else "FAILED")
                print(f"{system:20s} L={L:6d} round {repeat}: {state}", flush=True)
    payload = {"benchmark": "hf_trainer", "command": " ".join(["python", *sys.argv]),
               "model": {"name": MODEL, **SHAPE}, "world": a.world, "steps": STEPS,
               "lengths": a.lengths, "repeats": a.repeats,
               "measures": MEASURES, "rows": rows, **summarise(rows, a.lengths),
               "machine": machine, "date": common.now_iso(), "total_s": time.perf_counter() - t0}
    path = common.write_results(a.output, payload)
    for t in payload["targets"]:
        print(f"{t['result']}  {t['target']}  "
              + ", ".join(f"{k}={v}" for k, v in t.items() if k not in ("target", "result")))
    print(f"wrote {path}")
    print(_write_table(a.output, payload))


def _write_table(output: str, payload: dict) -> str:
    text = table(payload)
    path = common.results_path(output).with_suffix(".md")
    tmp = path.with_suffix(f".md.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return text


if __name__ == "__main__":
    if "--worker" in sys.argv:
        wa = argparse.ArgumentParser()
        wa.add_argument("--worker", required=True)
        wa.add_argument("--seq-len", type=int, required=True)
        wa.add_argument("--out", type=Path, required=True)
        w = wa.parse_args()
        worker(w.worker, w.seq_len, w.out)
    else:
        common.ensure_env()
        main()
