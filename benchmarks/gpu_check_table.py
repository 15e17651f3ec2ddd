"""The table docs/cuda.md quotes, made from gpu_check result files.

    python benchmarks/gpu_check_table.py                # the H200 runs in benchmarks/results
    python benchmarks/gpu_check_table.py FILE [FILE...]  # any gpu_check.json files

Each figure is read from the files (the newest file that holds a section wins; older ones
are named where a row compares before and after). Writes benchmarks/results/gpu_check_h200.md
when run on the default files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
# oldest first: the first run (kernels, train, generate; methods), the run after the FSDP
# offload fix (engine, attention probe), the run with torch's cuDNN op chosen on sm90
DEFAULT = ["gpu_check_h200_first.json", "gpu_check_h200_first_methods.json",
           "gpu_check_h200_offload_fix.json", "gpu_check_h200_cudnn.json"]

GB = 1e9


def _latest(reports: list[tuple[str, dict]], section: str) -> tuple[str, dict] | None:
    found = [(name, r["sections"][section]) for name, r in reports if section in r["sections"]]
    return found[-1] if found else None


def _first(reports, section):
    found = [(name, r["sections"][section]) for name, r in reports if section in r["sections"]]
    return found[0] if found else None


def rows(reports: list[tuple[str, dict]]) -> list[list[str]]:
    out = []
    kern = _latest(reports, "kernels")
    if kern:
        name, k = kern
        ran = [r for r in k["rows"] if "error" in r]
        half = [r for r in ran if r["dtype"] != "fp32"]
        out.append(["kernels against the fp32 reference (" + ", ".join(k["kernels"]) + ")",
                    f"{len(ran)} cases ran, {len(k['failed'])} failed; bf16/fp16 worst error "
                    f"{max(max(r['error'].values()) for r in half):.4f} "
                    f"(plain computation {max(max(r['plain_error'].values()) for r in half):.4f}); "
                    f"cuDNN fell back {len(k.get('cudnn_fell_back', []))} times", name])
    meth = _latest(reports, "methods")
    if meth:
        name, m = meth
        one = m["one_rank"]
        worst = max(max(r["error"].values()) for r in one if "error" in r)
        out.append(["every method at one rank, bf16, plain and packed",
                    f"{sum('error' in r for r in one)} of {len(one)} ran; worst error {worst:.4f}",
                    name])
        nccl = m.get("nccl_two_ranks_one_gpu", {}).get("answers", [])
        if nccl:
            out.append(["NCCL, two ranks on one GPU", nccl[0][2].split("Last error:")[-1].strip()
                        .splitlines()[0], name])
    att = _latest(reports, "attention")
    before = _first(reports, "attention")
    if att:
        name, a = att
        cells = [f"easy_context ({a['kernel']}) {a['easy_context']['tflops_per_s']:.0f}",
                 f"sdpa {a['torch_sdpa']['tflops_per_s']:.0f}"]
        if "torch_sdpa_flash_attention" in a:
            cells.append(f"sdpa flash {a['torch_sdpa_flash_attention']['tflops_per_s']:.0f}")
        if before and before[0] != name:
            cells.append(f"easy_context before the cuDNN path {before[1]['easy_context']['tflops_per_s']:.0f} "
                         f"({before[0]})")
        out.append([f"attention TFLOP/s, causal fwd+bwd, {a['L'] // 1024}K, {a['heads']} heads on "
                    f"{a['kv_heads']}, D={a['head_dim']}", "; ".join(cells), name])
        peak = a["easy_context"].get("peak_above_inputs_bytes")
        if peak:
            out.append(["one such call's peak above its inputs",
                        f"easy_context {peak / GB:.2f} GB, sdpa "
                        f"{a['torch_sdpa']['peak_above_inputs_bytes'] / GB:.2f} GB; modelled backward "
                        f"workspace {a['modelled_backward_workspace_bytes'] / GB:.2f} GB", name])
    for name, r in reports:
        train = r["sections"].get("train")
        if not train:
            continue
        for st in train.get("steps", []):
            label = f"Llama-3-8B-shaped step (2 layers, bf16), {st['L'] // 1024}K"
            if "failed" in st:
                out.append([label, st["failed"].split(".")[0], name])
            elif "skipped" not in st:
                out.append([label, f"fwd+bwd {st['forward_backward_s']} s, MFU {st['mfu']}, peak "
                                   f"{st['peak_allocated_above_weights_bytes'] / GB:.1f} GB = "
                                   f"{st['measured_over_predicted']} x planned", name])
        ml = train.get("max_length_mode")
        if ml and "loss" in ml:
            out.append([f"the same in max-length mode, {ml['L'] // 1024}K",
                        f"fwd+bwd {ml['forward_backward_s']} s, peak "
                        f"{ml['peak_allocated_above_weights_bytes'] / GB:.1f} GB = "
                        f"{ml['measured_over_predicted']} x planned", name])
    eng = _latest(reports, "engine")
    if eng:
        name, e = eng
        for part, label in (("tiny", "tiny model"), ("full_width", "2 layers at Llama-3-8B widths, 16K")):
            if part not in e:
                continue
            ran = [x for x in e[part]["rows"] if "loss" in x]
            skipped = sorted({x["skipped"] for x in e[part]["rows"] if "skipped" in x})
            failed = [x["setup"] for x in e[part]["rows"] if "failed" in x]
            text = f"{len(ran)} setups stepped, {len(failed)} failed"
            if skipped:
                text += " (" + "; ".join(skipped) + ")"
            if part == "full_width":
                text += "; GPU peak / planned: " + ", ".join(
                    f"{x['setup']} {x['peak_over_planned']}" for x in ran)
            out.append([f"trainer engine step, {label}", text, name])
    gen = _latest(reports, "generate")
    if gen:
        name, g = gen
        toks = g["tokens"]
        equal = sum(v.get("equal", False) for fam in toks.values() for v in fam.values())
        total = sum(len(fam) for fam in toks.values())
        out.append(["generate: greedy tokens equal to transformers' (fp32, "
                    + ", ".join(toks) + ")", f"{equal} of {total} method x family runs", name])
        sp = g["speed"]
        ec, tf = sp["easy_context"], sp["transformers"]
        out.append([f"generate, {sp['L'] // 1024}K prompt + {sp['new_tokens']} tokens, one run each "
                    "(transformers first)",
                    f"easy_context {ec['total_s']} s (prefill {ec['prefill_s']} s, "
                    f"{ec['decode_s_per_token'] * 1000:.2f} ms/token), transformers {tf['total_s']} s; "
                    f"{sp['tokens_agree']} of {sp['new_tokens']} tokens agree", name])
    return out


def table(reports: list[tuple[str, dict]]) -> str:
    first = reports[-1][1]["machine"]
    lines = [f"Measured on one {first.get('gpu')} (torch {first.get('torch')}, transformers "
             f"{first.get('transformers')}), {len(reports)} runs of benchmarks/gpu_check.py.", "",
             "| check | measured | file |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows(reports)]
    return "\n".join(lines) + "\n"


def load(paths: list[Path]) -> list[tuple[str, dict]]:
    return [(p.name, json.loads(p.read_text())) for p in paths]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(a) for a in args] or [RESULTS / n for n in DEFAULT]
    text = table(load(paths))
    if not args:
        (RESULTS / "gpu_check_h200.md").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
