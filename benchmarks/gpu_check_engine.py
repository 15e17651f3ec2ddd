"""gpu_check's engine section: one optimizer step of the trainer's own model and engine at one
rank, for each engine, offload setting, checkpointing kind, LoRA, QLoRA and max-length mode.

Each step runs in a child process that starts its process group the way ``easy-context
train`` does (launch.backend_for: NCCL and gloo in one group on CUDA) and under the strict
collective check (easy_context/utils/strict_collectives.py): on a GPU, a collective on host
tensors over a group without a host backend fails the step, which is how FSDP2's
``--offload`` crashed at its first step. The data is synthetic token ids (the lent GPU
machine has no ``datasets``); the model is saved with ``save_pretrained`` and loaded by the
trainer's sharded loader. Per step: the loss (finite), the gradient norm, the time, the
collectives seen, the planner's total and, on CUDA, the peak allocated memory from before the
model was built against it (on a CPU the peak is the process's high-water mark, which the
setups before it set: not comparable across rows). The
max-length step with offloaded inputs runs beside the same step without offload: their
time ratio is what the side-stream copies cost (1.0 when fully overlapped).

    python benchmarks/gpu_check_engine.py --tiny [--cpu]      # what gpu_check.py calls
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the modules whose change makes these results stale
MEASURES = ["easy_context/train/engines/fsdp.py", "easy_context/train/engines/deepspeed.py",
            "easy_context/launch.py", "easy_context/memory/offload.py",
            "easy_context/memory/checkpointing.py", "easy_context/memory/pinned.py"]

MAXLEN = {"mlp_tile": "128", "head_chunk": "2"}
SETUPS = [
    dict(name="fsdp", engine="fsdp"),
    dict(name="fsdp offload params", engine="fsdp", offload="params"),
    dict(name="fsdp checkpointing offload", engine="fsdp", checkpointing="offload"),
    dict(name="fsdp checkpointing attention", engine="fsdp", checkpointing="attention"),
    dict(name="fsdp offload params + checkpointing offload", engine="fsdp", offload="params",
         checkpointing="offload"),
    dict(name="deepspeed", engine="deepspeed"),
    dict(name="deepspeed offload optimizer", engine="deepspeed", offload="optimizer"),
    dict(name="deepspeed offload params", engine="deepspeed", offload="params"),
    dict(name="lora (fsdp, offload params)", engine="fsdp", offload="params", lora_rank=8),
    dict(name="qlora", engine="fsdp", lora_rank=8, lora_4bit=True),
    dict(name="max-length mode", engine="fsdp", **MAXLEN),
    dict(name="max-length mode, offloaded inputs with prefetch", engine="fsdp",
         checkpointing="offload", **MAXLEN),
]
NEEDS = {"deepspeed": "deepspeed", "lora_rank": "peft", "lora_4bit": "bitsandbytes"}


def model_config(tiny: bool):
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)
    # Llama-3-8B's widths, 2 layers
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=2, num_attention_heads=32, num_key_value_heads=8,
                       max_position_embeddings=131072, rope_theta=500000.0,
                       tie_word_embeddings=False)


def _missing(setup: dict) -> str | None:
    for key, pkg in NEEDS.items():
        if (setup.get("engine") == key or setup.get(key)) and importlib.util.find_spec(pkg) is None:
            return f"{pkg} is not installed"
    return None


def _planned(setup: dict, config, length: int, device) -> int:
    from easy_context.plan.estimate import estimate_memory
    from easy_context.plan.lora import LoRASpec
    from easy_context.plan.shapes import shape_from_config

    fused = {"mlp_tile": int(setup["mlp_tile"]), "heads_per_chunk": int(setup["head_chunk"])} \
        if "mlp_tile" in setup else {}
    lora = LoRASpec(setup["lora_rank"], base_4bit=bool(setup.get("lora_4bit"))) \
        if setup.get("lora_rank") else None
    est = estimate_memory(shape_from_config(config, "check"), length, 1, "local",
                          engine=setup.get("engine", "fsdp"), offload=setup.get("offload", "none"),
                          checkpointing=setup.get("checkpointing", "full"),
                          dtype="bf16" if device.type == "cuda" else "fp32",
                          device="gpu" if device.type == "cuda" else "cpu", lora=lora, **fused)
    return est.total


def child(model_dir: str, length: int, out: str) -> None:
    """Every setup in this process, one process group made as the trainer makes it."""
    import torch
    import torch.distributed as dist

    from easy_context.memory.peak import PeakMemory
    from easy_context.mesh import build_mesh
    from easy_context.train.config import TrainConfig
    from easy_context.train.trainer import _ensure_process_group, build_model_and_engine
    from easy_context.utils.strict_collectives import StrictCollectives
    from transformers import AutoConfig

    config_hf = AutoConfig.from_pretrained(model_dir)
    rows = []
    for setup in SETUPS:
        row = {"setup": setup["name"]}
        missing = _missing(setup)
        if missing:
            rows.append({**row, "skipped": missing})
            continue
        try:
            values = {k: v for k, v in setup.items() if k != "name"}
            config = TrainConfig(model=model_dir, dataset="synthetic", seq_length=length,
                                 mixed_precision="bf16" if torch.cuda.is_available() else "fp32",
                                 output_dir=tempfile.mkdtemp(), grad_clip=1.0,
                                 learning_rate=1e-4, **values)
            config.validate()
            device = _ensure_process_group(config)
            row["process_group_backend"] = str(dist.get_backend())
            mesh = build_mesh(1, None, device.type)
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, config_hf.vocab_size, (1, length + 1), generator=g)
            batch = {"input_ids": ids[:, :-1].to(device), "target_ids": ids[:, 1:].to(device),
                     "position_ids": torch.arange(length, device=device)[None]}
            denom = torch.tensor([float(length)], dtype=torch.float64, device=device)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                # what earlier setups in this process left allocated (the peak includes it)
                row["allocated_before_bytes"] = torch.cuda.memory_allocated(device)
            with StrictCollectives() as seen:
                model, engine = build_model_and_engine(config, device, mesh)
                with PeakMemory(device) as peak:
                    t0 = time.perf_counter()
                    loss = engine.loss(**batch, group=dist.group.WORLD, num_items_in_batch=denom)
                    engine.backward(loss)
                    norm = engine.clip_grad_norm(1.0)
                    engine.step()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    seconds = time.perf_counter() - t0
            planned = _planned(setup, config_hf, length, device)
            if device.type == "cuda":  # from before the model was built: what the plan totals
                row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
                row["peak_over_planned"] = round(row["peak_allocated_bytes"] / planned, 3)
            row.update({"loss": loss.item(), "loss_finite": bool(torch.isfinite(loss)),
                        "grad_norm": norm, "step_s": round(seconds, 3),
                        "peak_above_start_bytes": peak.peak_bytes, "planned_total_bytes": planned,
                        "collectives": dict(seen.counts)})
            del model, engine, loss
        except Exception as e:  # noqa: BLE001 - a failing setup is a finding
            row["failed"] = f"{type(e).__name__}: {e}"[:800]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        rows.append(row)
        Path(out).write_text(json.dumps(rows, indent=1))
    timed = {r["setup"]: r.get("step_s") for r in rows}
    plain, offload = (timed.get(SETUPS[-2]["name"]), timed.get(SETUPS[-1]["name"]))
    summary = {"offloaded_over_kept_step": round(offload / plain, 3) if plain and offload else None}
    Path(out).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))


def run(device, tiny: bool, log, length: int | None = None, timeout_s: float = 300) -> dict:
    """The section for gpu_check.py: build the model folder, run the child, read its rows."""
    import torch
    from transformers import AutoModelForCausalLM

    length = length or (256 if tiny else 16384)
    with tempfile.TemporaryDirectory() as work:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(model_config(tiny))
        model.save_pretrained(Path(work) / "model", safe_serialization=True)
        del model
        out = Path(work) / "rows.json"
        env = {k: v for k, v in os.environ.items()
               if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
        if device.type == "cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(Path(work) / "model"),
               "--length", str(length), "--out", str(out)]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
            error = None if done.returncode == 0 else done.stderr[-2000:]
        except subprocess.TimeoutExpired:
            error = f"timed out after {timeout_s} s"
        result = json.loads(out.read_text()) if out.exists() else {"rows": []}
        if isinstance(result, list):  # the child stopped before its summary
            result = {"rows": result}
    result.update({"L": length, "tiny": tiny, "error": error})
    for r in result["rows"]:
        log(f"engine: {r['setup']}: " + (r.get("failed") or r.get("skipped") or
                                          f"loss {r['loss']:.4f}, {r['step_s']} s"))
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--length", type=int, default=None)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--cpu", action="store_true")
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.length, args.out)
        return 0
    import torch

    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    print(json.dumps(run(device, args.tiny, lambda m: print(m, file=sys.stderr), args.length),
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
