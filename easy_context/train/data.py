"""Training data: load a tokenized dataset and cut it into (dp rank, step, micro-step) batches.

The order is a pure function of (seed, epoch), and batch b of an epoch holds the permuted
samples [b * B * dp, (b + 1) * B * dp), of which dp rank r takes its B. So:
- each data-parallel rank sees different samples; the sequence-parallel ranks of one group
  (same dp rank) see the same sample and each keeps its shard of it;
- the data position is just the number of micro-batches consumed: resuming needs no replay.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..errors import one_line

log = logging.getLogger(__name__)


def load_training_dataset(path_or_name: str, split: str = "train"):
    """A ``save_to_disk`` folder, a local dataset folder/file, or a dataset name."""
    import datasets

    path = Path(path_or_name)
    if path.is_dir() and ((path / "dataset_info.json").exists() or (path / "state.json").exists()
                          or (path / "dataset_dict.json").exists()):
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise ValueError(f"dataset {path} has splits {list(ds)}, not {split!r}")
            ds = ds[split]
    else:
        try:
            ds = datasets.load_dataset(path_or_name, split=split)
        except (FileNotFoundError, ConnectionError) as e:
            # ConnectionError: no such local folder, so datasets asked the Hub, unreachable
            raise FileNotFoundError(f"dataset {path_or_name!r} not found: give a folder written by "
                                    "`easy-context prepare-data` (or datasets.save_to_disk), or a "
                                    f"dataset name ({one_line(str(e))})") from e
    check_dataset(ds, path_or_name)
    return ds


def check_dataset(ds, name: str) -> None:
    if "input_ids" not in ds.column_names:
        raise ValueError(f"dataset {name} has no 'input_ids' column (columns: {ds.column_names}); "
                         "tokenize and pack it first with `easy-context prepare-data`")
    if len(ds) == 0:
        raise ValueError(f"dataset {name} is empty")


def check_windows(dataset, seq_length: int, batch_size: int, dp: int) -> None:
    """The dataset holds a step's worth of sequences, each long enough for ``seq_length``."""
    if len(dataset) < batch_size * dp:
        raise ValueError(f"the dataset has {len(dataset)} sequences; one step needs "
                         f"--batch-size x data-parallel groups = {batch_size} x {dp} = "
                         f"{batch_size * dp}: lower --batch-size or prepare more data")
    first = len(dataset[0]["input_ids"])
    if "pixel_values" in dataset.column_names and first != seq_length + 1:
        # windows of whole conversations: a shorter cut could split an image
        raise ValueError(f"the dataset's windows (with images) hold {first} tokens, prepared "
                         f"for --seq-length {first - 1}; train with --seq-length {first - 1} "
                         "(a shorter cut could split an image), or prepare the data again")
    if first < seq_length + 1:
        raise ValueError(f"sequences have {first} tokens; --seq-length {seq_length} needs "
                         f"{seq_length + 1} (targets are shifted by one): prepare the data "
                         f"with --seq-length {seq_length}, or lower --seq-length")


class TrainBatches:
    """Deterministic, resumable batches for one data-parallel rank."""

    def __init__(self, dataset, seq_length: int, batch_size: int, dp: int, dp_rank: int, seed: int):
        check_windows(dataset, seq_length, batch_size, dp)
        self.dataset = dataset.with_format("torch")
        self.seq_length, self.batch_size, self.dp, self.dp_rank, self.seed = (
            seq_length, batch_size, dp, dp_rank, seed)
        self.per_epoch = len(dataset) // (batch_size * dp)  # the remainder is dropped
        self._epoch, self._order = -1, None

    def _indices(self, micro_batch: int) -> list[int]:
        epoch, b = divmod(micro_batch, self.per_epoch)
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._order, self._epoch = torch.randperm(len(self.dataset), generator=gen), epoch
        start = (b * self.dp + self.dp_rank) * self.batch_size
        return self._order[start: start + self.batch_size].tolist()

    def get(self, micro_batch: int) -> dict[str, torch.Tensor]:
        """The ``micro_batch``-th batch of this dp rank: (B, L) input_ids, position_ids,
        target_ids (-100 where a target would cross into the next document, and where a
        ``labels`` column, if the data has one, says the token is not trained on)."""
        rows = self.dataset[self._indices(micro_batch)]
        L = self.seq_length
        ids = torch.as_tensor(rows["input_ids"])[:, : L + 1].long()
        inputs, targets = ids[:, :L].clone(), ids[:, 1:].clone()
        if "labels" in rows:
            # Instruction / chat data (prepare-data --chat): only the tokens the model must
            # learn to produce count (labels = the id there, -100 elsewhere).
            targets = torch.as_tensor(rows["labels"])[:, 1: L + 1].long().clone()
        if "position_ids" in rows:
            positions = torch.as_tensor(rows["position_ids"])[:, : L + 1].long()
            # a target that starts a new document cannot be predicted from the last one
            targets[positions[:, 1:] == 0] = -100
            positions = positions[:, :L]
        else:
            positions = torch.arange(L).expand(ids.size(0), -1)
        out = {"input_ids": inputs, "position_ids": positions.contiguous(), "target_ids": targets}
        if "pixel_values" in rows:
            # prepare-data --processor: the rows' images, concatenated in row order
            from .vision import window_images

            out.update(window_images(rows, ids.size(0)))
        return out
