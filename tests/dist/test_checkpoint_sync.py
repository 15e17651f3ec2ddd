"""Each rank fsyncs the checkpoint files it wrote itself, before the barrier; rank 0 syncs
only its own files and the folders' entries, then renames (easy_context.train.checkpoint).

Before, rank 0 fsynced every rank's files alone after the barrier while the others waited
(with the process-group timeout) -- on several nodes, through its own filesystem client.
``os.fsync`` is recorded on each of 2 gloo ranks (the path of each synced descriptor) during
a one-step run that saves one checkpoint, for both engines.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from easy_context.train.checkpoint import missing_rank_files
from tests.train_fixtures import tiny_dataset_dir, tiny_model_dir

from .train_cases import train_run


def synced_paths(workdir: str, name: str, engine: str) -> list[str]:
    """This rank's fsynced paths (as they were, in step_*.tmp) during a run that saves once."""
    synced: list[str] = []
    real = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd if isinstance(fd, int) else fd.fileno()}"))
        return real(fd)

    os.fsync = fsync
    try:
        train_run(workdir, name, engine=engine, max_train_steps=1, export=False,
                  parallel_mode="zigzag_ring_attn")
    finally:
        os.fsync = real
    return synced


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    work = tmp_path_factory.mktemp("ckpt_sync")
    tiny_model_dir(work / "model")
    tiny_dataset_dir(work / "data", seq_length=32, rows=8)
    return str(work)


@pytest.mark.parametrize("engine", ["fsdp", "deepspeed"])
def test_each_rank_syncs_its_own_files(dist2, workdir, engine):
    if engine == "deepspeed":
        pytest.importorskip("deepspeed")
    rank0, rank1 = dist2.run(synced_paths, workdir, f"sync_{engine}", engine)
    final = Path(workdir) / f"sync_{engine}" / "checkpoints" / "step_0000001"

    def in_final(paths):
        # Synced under step_0000001.tmp, now at step_0000001; DCP syncs its metadata as
        # .metadata.tmp and then renames it.
        return {Path(p.replace("step_0000001.tmp", "step_0000001").removesuffix(".metadata.tmp")
                     + (".metadata" if p.endswith(".metadata.tmp") else "")) for p in paths}

    files = {p for p in final.rglob("*") if p.is_file()}
    assert files and files <= in_final(rank0) | in_final(rank1)  # every file, by someone
    rank1_files = {p for p in files if p.name == "rng_rank1.pt" or p.name.startswith("__1_")
                   or "zero_pp_rank_1_" in p.name}
    assert rank1_files and rank1_files <= in_final(rank1)
    assert not rank1_files & in_final(rank0), "rank 0 synced rank 1's files"
    assert {final, final.parent} <= in_final(rank0)  # rank 0: the entries and the rename


def test_missing_rank_files_names_them(tmp_path):
    (tmp_path / "rng_rank0.pt").write_bytes(b"")
    (tmp_path / "rng_rank2.pt").write_bytes(b"")
    assert missing_rank_files(tmp_path, 3) == ["rng_rank1.pt"]
    assert missing_rank_files(tmp_path, 1) == []
