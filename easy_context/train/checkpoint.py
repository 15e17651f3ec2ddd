"""Training checkpoints, written atomically, and the Hugging Face export.

A checkpoint is a folder ``checkpoints/step_000123`` holding the engine's sharded model and
optimizer state, ``trainer_state.json`` (step, data position, scheduler, config) and one
``rng_rank{r}.pt`` per rank. All of it is first written to ``step_000123.tmp``; every rank
fsyncs the files it wrote, in parallel, before the barrier; then rank 0 syncs the folder's
entries and renames it: a crash leaves either the old checkpoint or the new one, never half
of one. ``checkpoints/latest`` names the newest complete checkpoint (written to a temporary
file and renamed, too).

Several nodes: ``--output-dir`` must be on a filesystem that every rank sees under the same
path (NFS, Lustre, GPFS, ...), with close-to-open consistency: a file one rank wrote, synced
and closed before the barrier is there for rank 0 after it. Each rank creates the folder
itself (another node may not see rank 0's mkdir at once), and rank 0 checks that every
rank's files arrived before it renames: on node-local disks they would not, and the run
stops with a message instead of leaving a checkpoint without them. Rank 0 never flushes
other ranks' data (it used to fsync every rank's files alone while the others waited on the
barrier, whose timeout is --pg-timeout-minutes).

RNG states are saved as tensors and lists and read back with ``weights_only=True``: loading
a checkpoint never unpickles arbitrary objects.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from ..utils.decoder import text_config


def _fsync(path: Path) -> None:
    """Flush a file's data, or a folder's entries, to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Every file, then every folder (deepest first), of ``folder``."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            _fsync(path)
    _fsync_folders(folder)


def _fsync_folders(folder: Path) -> None:
    for path in sorted((p for p in folder.rglob("*") if p.is_dir()), reverse=True):
        _fsync(path)
    _fsync(folder)


def missing_rank_files(folder: Path, world: int) -> list[str]:
    """The per-rank files that rank 0 cannot see in ``folder`` (a sign of node-local disks)."""
    return [f"rng_rank{r}.pt" for r in range(world) if not (folder / f"rng_rank{r}.pt").exists()]


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    py, npy = random.getstate(), np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": list(py[1]), "python_version": py[0],
             "python_gauss": py[2], "numpy": torch.from_numpy(npy[1].astype(np.int64)),
             "numpy_pos": npy[2], "numpy_gauss": [npy[3], npy[4]]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((state["python_version"], tuple(state["python"]), state["python_gauss"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"],
                         *state["numpy_gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def save_checkpoint(engine, output_dir: Path, step: int, trainer_state: dict) -> Path:
    """Collective: every rank calls it. Returns the final folder."""
    rank, world = dist.get_rank(), dist.get_world_size()
    root = checkpoint_dir(output_dir)
    final = root / f"step_{step:07d}"
    tmp = root / f"step_{step:07d}.tmp"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a crash during an earlier save
    dist.barrier()
    tmp.mkdir(parents=True, exist_ok=True)
    written = list(engine.save(tmp / "engine"))  # the files this rank must sync
    written.append(tmp / f"rng_rank{rank}.pt")
    torch.save(rng_state(), written[-1])
    if rank == 0:
        written.append(tmp / "trainer_state.json")
        written[-1].write_text(json.dumps(trainer_state, indent=1))
    for path in written:
        _fsync(path)
    dist.barrier()
    missing = [missing_rank_files(tmp, world) if rank == 0 else None]
    dist.broadcast_object_list(missing, src=0)  # every rank raises, or none
    if missing[0]:
        raise RuntimeError(f"checkpoint {tmp}: rank 0 does not see {missing[0]} that the other "
                           "ranks wrote: --output-dir must be one filesystem shared by every "
                           "node (NFS, Lustre, ...)")
    if rank == 0:
        _fsync_folders(tmp)  # the entries of the files just synced
        if final.exists():  # the same step saved again (e.g. the end of a resumed run)
            shutil.rmtree(final)
        os.replace(tmp, final)
        write_text_atomic(root / "latest", final.name)
        _fsync(root)  # the rename and the new pointer
    dist.barrier()
    return final


def latest_checkpoint(output_dir: Path) -> Path | None:
    root = checkpoint_dir(output_dir)
    pointer = root / "latest"
    if not pointer.exists():
        return None
    folder = root / pointer.read_text().strip()
    return folder if (folder / "trainer_state.json").exists() else None


def load_checkpoint(engine, folder: Path) -> dict:
    """Collective. Restores the engine and this rank's RNG; returns the trainer state."""
    engine.load(folder / "engine")
    rng_file = folder / f"rng_rank{dist.get_rank()}.pt"
    if not rng_file.exists():
        raise FileNotFoundError(f"{rng_file} is missing: resume with the same number of "
                                "processes as the run that wrote the checkpoint")
    set_rng_state(torch.load(rng_file, weights_only=True))
    return json.loads((folder / "trainer_state.json").read_text())


def export_hf(model, state_dict: dict, tokenizer, out_dir: Path,
              trained_length: int | None = None) -> None:
    """Rank 0: write a Hugging Face model folder (safetensors + config [+ tokenizer]),
    atomically, with no other weight files in it. ``trained_length``: the sequence length
    trained at; the config's ``max_position_embeddings`` is raised to it where lower (a
    model extended by raising RoPE's base is good for the length it was trained at, and
    generation checks prompts against that number)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    config = text_config(model.config)
    limit = getattr(config, "max_position_embeddings", None)
    if trained_length and isinstance(limit, int) and limit < trained_length:
        config.max_position_embeddings = trained_length
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    # The config records the module's dtype (bf16 under some engines); the weights written
    # are the fp32 master weights, and from_pretrained should load them as such.
    dtype = next((v.dtype for v in state_dict.values() if v.is_floating_point()), None)
    if dtype is not None:
        model.config.dtype = str(dtype).removeprefix("torch.")
        model.config.save_pretrained(tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    stray = [p.name for p in tmp.iterdir() if p.suffix in (".bin", ".pt", ".pth")]
    if stray:
        raise RuntimeError(f"export wrote non-safetensors weight files {stray}")
    _fsync_tree(tmp)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
