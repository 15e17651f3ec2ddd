"""prepare-data --processor: image conversations through a vision-language model's own
processor, packed whole into windows with their pixel values and grids (arrow columns).

Checked against the processor run on each conversation alone: the window's slice of every
conversation holds the processor's ids (its image tokens expanded), its pixel values and its
grids, bit for bit; labels only on the assistant turns; no image cut by a window edge. Bad
inputs give one line ``easy-context prepare-data: error: ...``.
"""

from __future__ import annotations

import json
import shutil

import datasets
import numpy as np
import pytest

from easy_context.cli import main
from tests.vision_fixtures import IMAGE, SEQ_LENGTH, conversations, vision_workdir, write_jsonl


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return vision_workdir(tmp_path_factory.mktemp("vision_data"))


def _prepare(work, family: str, source: str, name: str, *extra: str) -> tuple[int, str]:
    out = work["root"] / name
    shutil.rmtree(out, ignore_errors=True)
    code = main(["prepare-data", str(source), "--processor", str(work[family]),
                 "--seq-length", str(SEQ_LENGTH), "--output-dir", str(out), *extra])
    return code, str(out)


def _alone(work, family: str, record: dict):
    """The processor's ids, pixel values and grids for one conversation, run alone."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(work[family]))
    text = processor.apply_chat_template(record["messages"], tokenize=False)
    images = [Image.open(work["root"] / "data" / n).convert("RGB") for n in record["images"]]
    return processor(text=[text], images=images or None, return_tensors="np")


@pytest.mark.parametrize("family,source", [("qwen", "jsonl"), ("llava", "jsonl"),
                                           ("qwen", "saved")])
def test_windows_hold_what_the_processor_gives_each_conversation(work, family, source, capsys):
    code, out = _prepare(work, family, work[source], f"packed_{family}_{source}")
    assert code == 0, capsys.readouterr().err
    ds = datasets.load_from_disk(out)
    stats = json.loads((work["root"] / out / "stats.json").read_text())
    records = conversations([f"img{i}.png" for i in range(3)])
    assert stats["documents"] == len(records) and stats["images"] == 6
    seen = set()
    for row in ds:
        ids, docs = np.array(row["input_ids"]), np.array(row["document_ids"])
        labels, positions = np.array(row["labels"]), np.array(row["position_ids"])
        assert len(ids) == SEQ_LENGTH + 1
        pixels = np.array(row["pixel_values"], np.float32).reshape(row["pixel_values_shape"]) \
            if row["pixel_values_shape"][0] else None
        grids = np.array(row["image_grid_thw"]).reshape(-1, 3)
        pixel_at, grid_at = 0, 0
        for doc in dict.fromkeys(docs.tolist()):   # in window order
            where = docs == doc
            assert np.ptp(where.nonzero()[0]) == where.sum() - 1   # one run per conversation
            if doc == -1:                                      # the padding: no targets
                assert (labels[where] == -100).all() and where.nonzero()[0][-1] == len(ids) - 1
                continue
            seen.add(doc)
            want = _alone(work, family, records[doc])
            assert ids[where].tolist() == want["input_ids"][0].tolist()
            assert positions[where].tolist() == list(range(int(where.sum())))
            # labels: the assistant turn (after "<|im_start|> assistant"), never an image token
            learn = labels[where] != -100
            assert learn.any() and (labels[where][learn] == ids[where][learn]).all()
            assert not (learn & (ids[where] == IMAGE)).any()
            first = int(learn.nonzero()[0][0])
            assert ids[where][first - 1] == 89  # "assistant"
            if records[doc]["images"]:
                n = len(want["pixel_values"])
                np.testing.assert_array_equal(pixels[pixel_at:pixel_at + n], want["pixel_values"])
                pixel_at += n
                if "image_grid_thw" in want:
                    g = want["image_grid_thw"]
                    np.testing.assert_array_equal(grids[grid_at:grid_at + len(g)], g)
                    grid_at += len(g)
        assert pixel_at == (0 if pixels is None else len(pixels)) and grid_at == len(grids)
    assert seen == set(range(len(records)))


def _error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip().splitlines()   # progress bars aside
    lines = [line for line in err if line.startswith("easy-context")]
    assert code == 2 and len(lines) == 1 and err[-1] == lines[0], err
    assert lines[0].startswith("easy-context prepare-data: error: "), lines[0]
    return lines[0]


def test_bad_inputs_give_one_line(work, tmp_path, capsys):
    records = conversations([f"img{i}.png" for i in range(3)])
    bad = [dict(r) for r in records]
    bad[2] = {**bad[2], "images": ["img0.png", "missing.png"]}
    for i in range(3):
        shutil.copy(work["root"] / "data" / f"img{i}.png", tmp_path / f"img{i}.png")
    write_jsonl(tmp_path / "missing.jsonl", bad)
    write_jsonl(tmp_path / "nocol.jsonl", [{"messages": r["messages"]} for r in records])
    write_jsonl(tmp_path / "count.jsonl", [{**records[1], "images": []}])
    text = tmp_path / "tok"
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(str(work["qwen"])).save_pretrained(str(text))
    cases = [
        (tmp_path / "missing.jsonl", "qwen", (), "image file", "missing.png does not exist"),
        (tmp_path / "nocol.jsonl", "qwen", (), "has no column 'images'", "--images-column"),
        (tmp_path / "count.jsonl", "qwen", (), "1 image parts", "0 images"),
        (work["jsonl"], "qwen", ("--seq-length", "16"), "more than a window of 17",
         "image must not be cut"),
        (work["jsonl"], "qwen", ("--upsample-threshold", "10"), "--upsample-threshold",
         "does not apply to image conversations"),
    ]
    for source, family, extra, *fragments in cases:
        out = tmp_path / "out"
        code = main(["prepare-data", str(source), "--processor", str(work[family]),
                     "--seq-length", str(SEQ_LENGTH), "--output-dir", str(out), *extra])
        line = _error(capsys, code)
        for fragment in fragments:
            assert fragment in line, line
    code = main(["prepare-data", str(work["jsonl"]), "--processor", str(text),
                 "--output-dir", str(tmp_path / "out")])
    assert "vision-language processor" in _error(capsys, code)
    (text / "preprocessor_config.json").write_text("{}")    # a processor without images
    code = main(["prepare-data", str(work["jsonl"]), "--processor", str(text),
                 "--output-dir", str(tmp_path / "out")])
    assert "vision-language processor" in _error(capsys, code)
    code = main(["prepare-data", str(work["jsonl"]), "--output-dir", str(tmp_path / "out")])
    assert "pass --tokenizer (text data) or --processor" in _error(capsys, code)
