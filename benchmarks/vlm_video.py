"""A long video step of a tiny Qwen2.5-VL-shaped model: 2 sequence-parallel ranks vs one process.

Model: Qwen2_5_VLForConditionalGeneration from a config (random weights, fp32): text hidden
64, 2 layers, 4 heads (2 kv heads, head dim 16), vocabulary 1024; vision tower depth 2
(window attention, then full attention within each frame), hidden 64, 2x2 patches, temporal
patch 2, 2x2 merge. One sequence of L tokens (default 32,768): 128 text tokens, a video of
T temporal steps of 32x32 patches (256 tokens per step) filling the rest but 128 tokens of
text at the end. Targets: the text tokens (the video's are -100).

one  the model's own forward on the whole step (sdpa, pixel values and grids), loss from
     its logits, backward; one process, 1 thread (as each rank: see worker()).
sp2  2 gloo ranks (easy_context.testing.DistPool, 1 thread each), zigzag_ring_attn, logits
     path (vocabulary 1024):
     prepare_vision_inputs (each rank encodes only the video frames its tokens hold),
     causal_lm_loss(..., vision=), backward.

Each mode runs in a fresh process with MALLOC_MMAP_THRESHOLD_=65536. Per rank: the step's
time (forward + backward) and its peak resident memory above the start
(easy_context.memory.peak.PeakMemory), the frames it encoded, and the loss (the same in both
modes up to fp32 rounding: the check that the long step is exact too).

    python benchmarks/vlm_video.py                 # 32K tokens, writes results/vlm_video.json
    python benchmarks/vlm_video.py --tokens 4096 --out /tmp/v.json   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import common  # noqa: E402

# the modules whose change makes these results stale
MEASURES = ["easy_context/integrations/vision.py", "easy_context/integrations/hf.py",
            "easy_context/parallel", "easy_context/attention", "easy_context/memory/loss.py"]
RESULTS = Path(__file__).resolve().parent / "results" / "vlm_video.json"
MB = 2**20
VIDEO, TEXT = 91, 128  # the video's placeholder id; text tokens at each end


def _model():
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=1024, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=65536, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "rope_theta": 1e6}),
        vision_config=dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=4,
                           out_hidden_size=64, patch_size=2, temporal_patch_size=2,
                           spatial_merge_size=2, window_size=8, fullatt_block_indexes=[1]),
        image_token_id=90, video_token_id=VIDEO, vision_start_token_id=92,
        vision_end_token_id=93)
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration._from_config(config,
                                                           attn_implementation="sdpa").float()


def _step(tokens: int):
    import torch

    steps = (tokens - 2 * TEXT) // 256
    length = 2 * TEXT + steps * 256
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 89, (1, length), generator=gen)
    ids[0, TEXT:TEXT + steps * 256] = VIDEO
    targets = torch.randint(3, 89, (1, length), generator=gen)
    targets[0, TEXT - 1:TEXT + steps * 256] = -100
    grid = torch.tensor([[steps, 32, 32]])
    pixels = torch.randn(steps * 1024, 3 * 2 * 2 * 2, generator=gen)
    return ids, targets, pixels, grid


def measure(mode: str, tokens: int, warmup: bool = True) -> dict:
    import torch.distributed as dist

    from easy_context.memory.peak import PeakMemory

    model = _model()
    if warmup:  # first calls pay one-time costs (seconds in the vision tower): a short step
        _loss(model, mode, *_step(2 * TEXT + 2 * 256), {}).backward()
        model.zero_grad(set_to_none=True)
    ids, targets, pixels, grid = _step(tokens)
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {"rank": rank, "tokens": ids.size(1), "video_steps": int(grid[0, 0])}
    if dist.is_initialized():
        dist.barrier()
    t0, cpu0 = time.perf_counter(), time.process_time()
    with PeakMemory("cpu") as pm:
        loss = _loss(model, mode, ids, targets, pixels, grid, out)
        loss.backward()
    if dist.is_initialized():
        dist.barrier()
    cpu = time.process_time() - cpu0  # this process's CPU time: its work, whatever the load
    out.update(loss=loss.item(), step_s=time.perf_counter() - t0, step_cpu_s=cpu,
               step_peak_mb=None if pm.peak_bytes is None else pm.peak_bytes / MB,
               process_peak_mb=None if pm.process_peak_bytes is None
               else pm.process_peak_bytes / MB)
    return out


def _loss(model, mode: str, ids, targets, pixels, grid, out: dict):
    """The step's loss: the model's own forward (one) or the sequence-parallel loss (sp2)."""
    import torch.distributed as dist
    import torch.nn.functional as F

    if mode == "one":
        logits = model(input_ids=ids, pixel_values_videos=pixels, video_grid_thw=grid,
                       mm_token_type_ids=2 * (ids == VIDEO).int()).logits.float()
        out["frames_encoded"] = int(grid[0, 0])
        return F.cross_entropy(logits[0], targets[0], ignore_index=-100)
    import easy_context as ec

    rank, world = dist.get_rank(), dist.get_world_size()
    ec.apply_sequence_parallel(model, "zigzag_ring_attn")
    local = ec.prepare_vision_inputs(model, "zigzag_ring_attn", ids, targets, rank, world,
                                     pixel_values_videos=pixels, video_grid_thw=grid)
    out["frames_encoded"] = sum(len(m.encoded) for m in local["vision"].media)
    return ec.causal_lm_loss(model, local["local_input_ids"], local["local_position_ids"],
                             local["local_target_ids"], vision=local["vision"], chunked=False)


def worker(mode: str, tokens: int, timeout_s: float) -> dict:
    import torch

    if mode == "one":
        # one thread, as each rank has: on a loaded 2-core machine two threads in one process
        # measured ten times slower than one (2.1 s vs 24.5 s at 2,304 tokens)
        torch.set_num_threads(1)
        return {"ranks": [measure("one", tokens)]}
    from easy_context.testing import DistPool

    with DistPool(2, threads_per_rank=1, timeout_s=timeout_s, pg_timeout_s=timeout_s) as pool:
        return {"ranks": pool.run(measure, "sp2", tokens, timeout_s=timeout_s)}


def _run(mode: str, tokens: int, timeout_s: float) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--worker", mode, "--tokens", str(tokens),
           "--timeout-s", str(timeout_s)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout_s + 120)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{mode} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return {"mode": mode, "wall_s": time.perf_counter() - t0,
            **json.loads(lines[-1][len("RESULT "):])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--timeout-s", type=float, default=1500)
    p.add_argument("--worker", choices=["one", "sp2"], help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="JSON output (default: results/vlm_video.json "
                   "at 32K tokens)")
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args.worker, args.tokens, args.timeout_s)),
              flush=True)
        return 0
    load_before = os.getloadavg()
    runs = [_run(mode, args.tokens, args.timeout_s) for mode in ("one", "sp2")]
    one = runs[0]["ranks"][0]
    for run in runs:
        for r in run["ranks"]:
            print(f"{run['mode']:4s} rank {r['rank']}: {r['step_s']:7.1f} s/step "
                  f"({r['step_cpu_s']:.1f} s CPU), peak "
                  f"{r['step_peak_mb']:8.1f} MB above the start, {r['frames_encoded']:3d} of "
                  f"{r['video_steps']} video steps encoded, loss {r['loss']:.6f}")
    sp = runs[1]["ranks"]
    summary = {
        "step_s_ratio_sp2_over_one": max(r["step_s"] for r in sp) / one["step_s"],
        "step_cpu_s_ratio_sp2_over_one": max(r["step_cpu_s"] for r in sp) / one["step_cpu_s"],
        "peak_ratio_sp2_over_one": max(r["step_peak_mb"] for r in sp) / one["step_peak_mb"],
        "loss_rel_diff": max(abs(r["loss"] - one["loss"]) for r in sp) / abs(one["loss"]),
    }
    print(json.dumps(summary))
    payload = {"what": __doc__.splitlines()[0], "tokens": one["tokens"], "runs": runs,
               "summary": summary, "measures": MEASURES,
               "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
               "machine": common.machine_info()}
    out = args.out or (RESULTS if args.tokens == 32768 else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
