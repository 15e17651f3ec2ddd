"""Bad command lines, through ``easy_context.cli.main`` in this process: every flag of train,
recipe, plan, demo, eval-needle, eval-ppl and plot-ppl with its bad values. Each must give
one line, ``easy-context <command>: error: <message>``, no traceback, exit status 2, and a
message that names what to change; all fail before any rank starts or any model loads.
(tests/dist/test_cli_ranks.py runs the command as a user does, in a subprocess.)"""

from __future__ import annotations

import json

import pytest

from easy_context.cli import main
from tests.train_fixtures import tiny_dataset_dir, tiny_model_dir
from tests.unit.eval_fixtures import random_model_dir


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    """Everything the bad command lines point at, named for the ``{...}`` in the table."""
    import datasets

    root = tmp_path_factory.mktemp("cli_errors")
    p = {"tmp": str(root), "missing": str(root / "missing")}
    p["model"] = str(tiny_model_dir(root / "model"))  # no tokenizer
    p["data"] = str(tiny_dataset_dir(root / "data", seq_length=32, rows=16))
    p["emodel"] = str(random_model_dir(root / "emodel"))  # with a tokenizer
    (root / "config_only").mkdir()
    (root / "config_only" / "config.json").write_text((root / "model" / "config.json").read_text())
    p["config_only"] = str(root / "config_only")
    (root / "empty").mkdir()
    p["empty"] = str(root / "empty")
    (root / "afile").write_text("not a folder")
    p["afile"] = str(root / "afile")
    datasets.Dataset.from_dict({"text": ["abc"]}).save_to_disk(str(root / "textd"))
    p["textd"] = str(root / "textd")
    datasets.Dataset.from_dict({"input_ids": [list(range(3, 200))] * 2}).save_to_disk(
        str(root / "tokd"))
    p["tokd"] = str(root / "tokd")
    (root / "docs.jsonl").write_text(json.dumps({"text": "hello world " * 50}) + "\n")
    p["docs"] = str(root / "docs.jsonl")
    (root / "hay").mkdir()
    (root / "hay" / "a.txt").write_text("   \n")
    p["blank_hay"] = str(root / "hay")
    (root / "short_hay").mkdir()
    (root / "short_hay" / "a.txt").write_text("A short haystack. Two sentences.\n")
    p["short_hay"] = str(root / "short_hay")
    files = {
        "bad_type.yaml": "seq_length: abc\n",
        "broken.yaml": "a: [1,\n",
        "unknown_key.yaml": "sequence_len: 4\n",
        "bad.json": "{not json",
        "ds.json": "{}",
        "bad.csv": "model,x\n",
        "no_stages.yaml": "name: x\n",
        "bad_stage.yaml": f"stages:\n  - name: a\n    model: {p['model']}\n    dataset: "
                          f"{p['data']}\n    seq_length: -4\n",
        "bad_nproc.yaml": f"nproc_per_node: two\nstages:\n  - name: a\n    model: {p['model']}\n"
                          f"    dataset: {p['data']}\n",
        "bad_theta.yaml": f"stages:\n  - name: a\n    model: {p['model']}\n    dataset: "
                          f"{p['data']}\n  - name: e\n    set_rope_theta: abc\n",
        "late_data.yaml": f"stages:\n  - name: a\n    model: {p['model']}\n    dataset: {p['data']}"
                          f"\n    seq_length: 32\n  - name: b\n    dataset: {root}/no/such/data\n"
                          "    seq_length: 32\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
        p[name.replace(".", "_")] = str(root / name)
    return p


TRAIN = "train --model {model} --dataset {data} --seq-length 32 --output-dir {tmp}/out"
GENERATE = "generate --model {emodel} --prompt hello --max-new-tokens 4"
EVAL_NEEDLE = "eval-needle --model {emodel} --min-context-length 256 --max-context-length 256 " \
              "--output-dir {tmp}/needle"
EVAL_PPL = "eval-ppl --model {emodel} --tokenized {tokd} --min-tokens 64 --max-tokens 128 " \
           "--output-file {tmp}/ppl.csv"

# (command line, what the message must say); every one exits with 2.
CASES = [
    # the command line itself (argparse)
    ("frob", "invalid choice: 'frob'"),
    ("plan --devices abc", "argument --devices: invalid int value: 'abc'"),
    ("train --seq-length", "argument --seq-length: expected one argument"),
    (TRAIN + " --checkpointing some", "argument --checkpointing: invalid choice"),
    ("train --dataset {data}", "--model is required"),
    ("train --model {model}", "--dataset is required"),
    # plan
    ("plan --devices 0", "--devices must be >= 1, got 0"),
    ("plan --seq-len -5", "--seq-len must be >= 1"),
    ("plan --granularity 0", "--granularity must be >= 1"),
    ("plan --gpu-memory 0", "--gpu-memory is in GiB and must be > 0"),
    ("plan --usable 1.5", "--usable is a fraction"),
    ("plan --loss-chunk -1 --seq-len 8192", "--loss-chunk must be >= 0"),
    ("plan --method usp_attn --ring-degree 0", "--ring-degree must be >= 1"),
    ("plan --ring-degree 2", "--ring-degree is usp_attn's"),
    ("plan --method usp_attn --ring-degree 3 --devices 8 --seq-len 8192", "does not divide"),
    ("plan --method ulysses_attn --devices 3 --seq-len 8192", "32 query heads cannot be split over 3"),
    ("plan --method ring", "argument --method: invalid choice"),
    ("plan --model {missing}", "model folder {missing} does not exist"),
    ("plan --model {empty}", "model folder {empty} has no config.json"),
    ("plan --model Llama-9-1T", "unknown model 'Llama-9-1T'"),
    ("plan --report table --output {afile}/x.md", "{afile} is a file, not a folder"),
    # train: values
    (TRAIN.replace("32", "0"), "--seq-length must be >= 1, got 0"),
    (TRAIN + " --batch-size 0", "--batch-size must be >= 1"),
    (TRAIN + " --gradient-accumulate-every 0", "--gradient-accumulate-every must be >= 1"),
    (TRAIN + " --max-train-steps 0", "--max-train-steps must be >= 1"),
    (TRAIN + " --auto-memory-budget 40", "--auto-memory-budget is the planner's budget: add --auto-memory"),
    (TRAIN + " --auto-memory --auto-memory-budget 0", "--auto-memory-budget must be > 0"),
    (TRAIN + " --log-every 0", "--log-every must be >= 1"),
    (TRAIN + " --nproc-per-node 0", "--nproc-per-node must be >= 1"),
    (TRAIN + " --sp-size 0", "--sp-size must be >= 1"),
    (TRAIN + " --learning-rate 0", "--learning-rate must be > 0"),
    (TRAIN + " --learning-rate nan", "--learning-rate must be > 0, got nan"),
    (TRAIN + " --warmup-steps -1", "--warmup-steps must be >= 0"),
    (TRAIN + " --save-every -1", "--save-every must be >= 0"),
    (TRAIN + " --grad-clip -1", "--grad-clip must be >= 0"),
    (TRAIN + " --pg-timeout-minutes 0", "--pg-timeout-minutes must be > 0"),
    (TRAIN + " --rope-theta -1", "--rope-theta must be > 0"),
    (TRAIN + " --rope-scaling bogus", "--rope-scaling must be JSON or TYPE:FACTOR"),
    (TRAIN + " --parallel-mode foo", "unknown sequence-parallel method 'foo'"),
    (TRAIN + " --parallel-mode usp_attn", "usp_attn needs --ring-degree"),
    (TRAIN + " --ring-degree 2", "--ring-degree applies to usp_attn only"),
    (TRAIN + " --parallel-mode data_parallel --sp-size 2", "data_parallel has no sequence"),
    # train: against the ranks of the run
    (TRAIN.replace("32", "30") + " --nproc-per-node 2", "--seq-length 30 is not divisible by 4"),
    (TRAIN + " --sp-size 3 --nproc-per-node 2", "--sp-size 3 is more than the 2 ranks"),
    (TRAIN + " --sp-size 2 --nproc-per-node 3", "world size 3 is not divisible by --sp-size 2"),
    (TRAIN + " --parallel-mode usp_attn --ring-degree 3 --nproc-per-node 2",
     "--ring-degree 3 does not divide the sequence-parallel size 2"),
    (TRAIN + " --parallel-mode ulysses_attn --nproc-per-node 3",  # the model's 4 heads
     "4 query heads cannot be split over 3"),
    # train: files
    (TRAIN.replace("{model}", "{missing}"), "model folder {missing} does not exist"),
    (TRAIN.replace("{model}", "{empty}"), "has no config.json"),
    (TRAIN.replace("{model}", "{config_only}"), "has no safetensors weights"),
    (TRAIN.replace("{data}", "{missing}"), "--dataset {missing} does not exist"),
    (TRAIN.replace("{data}", "{textd}"), "has no 'input_ids' column"),
    (TRAIN.replace("32", "64"), "sequences have 33 tokens; --seq-length 64 needs 65"),
    (TRAIN + " --batch-size 100", "the dataset has 16 sequences"),
    (TRAIN.replace("{tmp}/out", "{afile}"), "--output-dir {afile} is a file"),
    (TRAIN + " --config {missing}.yaml", "no such file"),
    (TRAIN.replace(" --seq-length 32", "") + " --config {bad_type_yaml}",
     "--seq-length must be an integer, got 'abc'"),
    (TRAIN + " --config {broken_yaml}", "is not valid YAML"),
    (TRAIN + " --config {unknown_key_yaml}", "unknown key 'sequence_len'"),
    (TRAIN + " --engine deepspeed --deepspeed-config {missing}.json", "no such file"),
    (TRAIN + " --engine deepspeed --deepspeed-config {bad_json}", "is not valid JSON"),
    (TRAIN + " --deepspeed-config {ds_json}", "--deepspeed-config needs --engine deepspeed"),
    # recipe
    ("recipe nope --dry-run", "neither a file nor a bundled recipe (llama2_7b_1m"),
    ("recipe {broken_yaml}", "is not valid YAML"),
    ("recipe {no_stages_yaml}", "non-empty 'stages' list"),
    ("recipe {bad_stage_yaml}", "stage 'a': --seq-length must be >= 1"),
    ("recipe {bad_nproc_yaml}", "nproc_per_node must be an integer >= 1, got 'two'"),
    ("recipe {bad_theta_yaml}", "stage 'e': set_rope_theta must be a number > 0"),
    ("recipe {late_data_yaml} --output-dir {tmp}/r", "stage 'b': --dataset"),
    ("recipe tiny_cpu_demo --output-dir {afile}", "--output-dir {afile} is a file"),
    # demo
    ("demo --quick --nproc-per-node 0 --output-dir {tmp}/d", "--nproc-per-node must be >= 1"),
    ("demo --quick --nproc-per-node 3 --output-dir {tmp}/d", "--nproc-per-node 3 cannot split"),
    ("demo --quick --seed -1 --output-dir {tmp}/d", "--seed must be >= 0"),
    ("demo --quick --output-dir {afile}", "--output-dir {afile} is a file"),
    # eval-needle
    (EVAL_NEEDLE.replace("{emodel}", "{missing}"), "model folder {missing} does not exist"),
    (EVAL_NEEDLE.replace("{emodel}", "{model}"), "has no tokenizer (tokenizer.json)"),
    (EVAL_NEEDLE + " --haystack-dir {missing}", "haystack folder {missing} does not exist"),
    (EVAL_NEEDLE + " --haystack-dir {empty}", "has no .txt files"),
    (EVAL_NEEDLE + " --haystack-dir {blank_hay}", "its .txt files are empty"),
    (EVAL_NEEDLE + " --min-context-length 512", "is greater than --max-context-length"),
    (EVAL_NEEDLE + " --context-interval 0", "--context-interval must be positive"),
    (EVAL_NEEDLE + " --depth-interval 0", "--depth-interval must be in (0, 1]"),
    (EVAL_NEEDLE + " --depth-interval 1.5", "--depth-interval must be in (0, 1]"),
    (EVAL_NEEDLE + " --num-samples 0", "--num-samples, --rnd-number-digits and --num-values"),
    (EVAL_NEEDLE + " --rnd-number-digits 0", "--num-samples, --rnd-number-digits and"),
    (EVAL_NEEDLE + " --num-values 0", "--num-samples, --rnd-number-digits and --num-values"),
    (EVAL_NEEDLE + " --num-distractor -1", "--num-distractor must be >= 0"),
    (EVAL_NEEDLE + " --num-distractor 1000", "--num-distractor must be below"),
    (EVAL_NEEDLE + " --generate --nproc-per-node 2", "--generate runs in one process"),
    (EVAL_NEEDLE.replace("--min-context-length 256", "--min-context-length 40"),
     "context length 40 is too short for the prompt template and needles"),
    (EVAL_NEEDLE + " --haystack-dir {short_hay} --no-repeat-haystack",
     "but the longest context needs 256; add text"),
    (EVAL_NEEDLE + " --nproc-per-node 0", "--nproc-per-node must be >= 1"),
    (EVAL_NEEDLE + " --parallel-mode data_parallel --nproc-per-node 2", "evaluates in one process"),
    (EVAL_NEEDLE + " --parallel-mode foo", "unknown sequence-parallel method 'foo'"),
    (EVAL_NEEDLE + " --parallel-mode usp_attn --nproc-per-node 2", "usp_attn needs ring_degree"),
    (EVAL_NEEDLE + " --parallel-mode usp_attn --ring-degree 3 --nproc-per-node 2",
     "ring_degree=3 does not divide the 2 ranks"),
    (EVAL_NEEDLE + " --parallel-mode ulysses_attn --nproc-per-node 3",
     "4 query heads cannot be split over 3"),
    (EVAL_NEEDLE + " --ring-degree 1", "ring_degree applies to usp_attn only"),
    (EVAL_NEEDLE + " --rope-theta 0", "--rope-theta must be > 0"),
    (EVAL_NEEDLE + " --rope-scaling yarn", "--rope-scaling must be JSON or TYPE:FACTOR"),
    (EVAL_NEEDLE + " --dtype fp8", "argument --dtype: invalid choice"),
    (EVAL_NEEDLE.replace("{tmp}/needle", "{afile}"), "--output-dir {afile} is a file"),
    # generate
    ("generate --model {emodel}", "one of the arguments --prompt --prompt-file is required"),
    (GENERATE.replace("{emodel}", "{missing}"), "model folder {missing} does not exist"),
    (GENERATE.replace("{emodel}", "{model}"), "has no tokenizer (tokenizer.json)"),
    (GENERATE.replace("--prompt hello", "--prompt-file {missing}"), "--prompt-file {missing} does not exist"),
    (GENERATE + " --max-new-tokens 0", "--max-new-tokens must be >= 1"),
    (GENERATE + " --do-sample --temperature 0", "temperature must be > 0 when sampling"),
    (GENERATE + " --top-p 0", "top_p must be in (0, 1]"),
    (GENERATE + " --top-k -1", "top_k must be >= 1"),
    (GENERATE + " --min-p 2", "min_p must be in [0, 1]"),
    (GENERATE + " --repetition-penalty 0", "--repetition-penalty must be > 0"),
    (GENERATE + " --min-new-tokens -1", "--min-new-tokens must be >= 0"),
    (GENERATE + " --nproc-per-node 0", "--nproc-per-node must be >= 1"),
    (GENERATE + " --parallel-mode ulysses_attn --nproc-per-node 3",
     "4 query heads cannot be split over 3"),
    (GENERATE + " --max-new-tokens 2000", "exceed the model's RoPE range (max_position_embeddings=1024)"),
    (GENERATE + " --chat", "--chat: the tokenizer has no chat template"),
    (GENERATE + " --output {tmp}", "--output {tmp} is a folder"),
    # eval-ppl
    ("eval-ppl --model {emodel}", "one of the arguments --tokenized --dataset is required"),
    (EVAL_PPL.replace("{tokd}", "{missing}"), "--tokenized {missing} does not exist"),
    (EVAL_PPL.replace("{tokd}", "{textd}"), "has no input_ids column (['text']); for text, use --dataset"),
    (EVAL_PPL.replace("{tokd}", "{empty}"), "is not a saved dataset"),
    (EVAL_PPL.replace("--tokenized {tokd}", "--dataset {missing}.jsonl"), "does not exist"),
    (EVAL_PPL.replace("{emodel} --tokenized {tokd}", "{model} --dataset {docs}"),
     "has no tokenizer (tokenizer.json); this eval turns text into tokens"),
    (EVAL_PPL.replace("{emodel}", "{config_only}"), "has no safetensors weights"),
    (EVAL_PPL + " --samples 0", "--samples must be >= 1"),
    (EVAL_PPL + " --dataset-min-tokens -1", "--dataset-min-tokens must be >= 0"),
    (EVAL_PPL.replace("--min-tokens 64", "--min-tokens 0"), "--min-tokens, --sliding-window"),
    (EVAL_PPL.replace("--max-tokens 128", "--max-tokens 32"), "is greater than --max-tokens"),
    (EVAL_PPL + " --tokens-step 0", "--tokens-step must be positive"),
    (EVAL_PPL + " --sliding-window 0", "--min-tokens, --sliding-window and --last-k"),
    (EVAL_PPL + " --last-k 0", "--min-tokens, --sliding-window and --last-k"),
    (EVAL_PPL + " --output-dir {tmp}", "argument --output-dir: not allowed with argument --output-file"),
    (EVAL_PPL.replace("{tmp}/ppl.csv", "{afile}/ppl.csv"), "{afile} is a file, not a folder"),
    # plot-ppl
    ("plot-ppl {missing}.csv", "{missing}.csv does not exist"),
    ("plot-ppl {bad_csv}", "is not an eval-ppl CSV: no ['context_length', 'ppl'] column"),
]


def _run(argv: str, paths: dict, capsys) -> tuple[int, str]:
    code = main(argv.format(**paths).split())
    return code, capsys.readouterr().err


def _case_id(argv: str) -> str:
    """The command and what differs from its base line, e.g. "train --batch-size 0"."""
    for base, name in ((TRAIN, "train"), (EVAL_NEEDLE, "eval-needle"), (EVAL_PPL, "eval-ppl"),
                       (GENERATE, "generate")):
        if argv.startswith(base):
            return name + argv[len(base):]
    return argv


@pytest.mark.parametrize("argv,fragment", CASES, ids=[_case_id(c[0]) for c in CASES])
def test_bad_value_gives_one_line_and_status_2(paths, capsys, monkeypatch, argv, fragment):
    from easy_context.eval import cli

    # eval-needle with one process would run its rank in this process: it must not get there
    monkeypatch.setattr(cli, "launch", lambda *a: pytest.fail("launched despite a bad input"))
    code, err = _run(argv, paths, capsys)
    command = argv.split()[0]
    prefix = f"easy-context {command}: error: " if command != "frob" else "easy-context: error: "
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert code == 2, err
    assert len(errors) == 1 and errors[0].startswith(prefix), err
    assert fragment.format(**paths) in errors[0]
    assert "Traceback" not in err


def test_plot_ppl_values(paths, capsys, tmp_path):
    """plot-ppl's numeric flags, on a real eval-ppl CSV."""
    csv = tmp_path / "ppl.csv"
    csv.write_text("model,context_length,ppl,last_k_ppl\nm,64,3.0,2.0\n")
    for argv, fragment in ((f"plot-ppl {csv} --ymin 5 --ymax 1", "--ymin (5.0) must be below"),
                           (f"plot-ppl {csv} --xmax 0", "--xmax must be > 0"),
                           (f"plot-ppl {csv} --output {{afile}}/x.png", "is a file, not a folder")):
        code, err = _run(argv, paths, capsys)
        assert code == 2 and err.count(": error: ") == 1 and fragment in err, err


def test_debug_prints_the_traceback_before_the_line(paths, capsys, monkeypatch):
    for argv in ("--debug plan --devices 0", "plan --devices 0 --debug"):
        code, err = _run(argv, paths, capsys)
        assert code == 2 and "Traceback (most recent call last)" in err
        assert "in check_plan_args" in err  # where the error was raised
        assert err.splitlines()[-1] == "easy-context plan: error: --devices must be >= 1, got 0"
    monkeypatch.setenv("EASY_CONTEXT_DEBUG", "1")
    code, err = _run("plan --devices 0", paths, capsys)
    assert code == 2 and "Traceback" in err
    monkeypatch.setenv("EASY_CONTEXT_DEBUG", "0")
    assert "Traceback" not in _run("plan --devices 0", paths, capsys)[1]


def test_debug_prints_a_failed_ranks_own_traceback(capsys):
    """A RankError under --debug: the rank's traceback (the one of this process only shows
    launch() re-raising), then the one error line, last. A real 2-rank failure through the
    command line without --debug: tests/dist/test_cli_ranks.py."""
    from easy_context.cli import report_error
    from easy_context.errors import RankError

    rank_tb = ('Traceback (most recent call last):\n  File "loader.py", line 9, in load\n'
               "safetensors_rust.SafetensorError: Error while deserializing header\n")
    try:
        raise RankError(1, "SafetensorError", "Error while deserializing header", rank_tb)
    except RankError as e:
        assert report_error("train", e, debug=True) == 1
    err = capsys.readouterr().err
    before, line = err.rsplit("easy-context train: error:", 1)
    assert before == rank_tb  # the rank's own, not this process's
    assert line == " rank 1: Error while deserializing header\n"


def test_help_lists_debug(capsys):
    for argv in ([], ["--debug"]):
        assert main(argv) == 0
        assert "--debug" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["plan", "--help"])
    assert e.value.code == 0 and "--debug" in capsys.readouterr().out


def test_under_torchrun_each_process_says_its_rank(paths, capsys, monkeypatch):
    # torchrun starts the command once per rank (python -m easy_context.train): every
    # failing process prints its line, so each line says which rank it comes from.
    from easy_context.train.__main__ import main as train_main

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert train_main(["--model", paths["model"], "--dataset", paths["data"],
                       "--seq-length", "0"]) == 2
    assert capsys.readouterr().err == ("easy-context train: error: rank 1: --seq-length must "
                                       "be >= 1, got 0\n")
