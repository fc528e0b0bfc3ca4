"""The loss table of QuantDDP with the ``eden`` codec on a large-vocabulary model, from the JSON files that
``benchmarks/onebit_vocab_convergence.py`` wrote (one run per variant: ``--model <model> --steps <steps> --seeds 0
--variants <v> --out benchmarks/results/eden_<model>_<v>.json``), into ``benchmarks/results/eden_<model>_loss.md``.
Models: ``demo`` (Lightning's demo transformer, 24,113 tokens; 160 steps) and ``gpt2`` (the GPT-2 shape with its
50,257-token vocabulary; 300 steps).

Each row: the training loss over the last 5 steps (mean of the 2 ranks; seed 0), and its gap to DDP's (the
``ddp_adamw`` run), ``loss / loss_DDP - 1``, with the run's device, torch, commit and date from its JSON. The step
count in the header is read from the runs' commands; runs of different lengths are refused.

    python benchmarks/eden_demo_table.py               # benchmarks/results/eden_demo_loss.md
    python benchmarks/eden_demo_table.py --model gpt2  # benchmarks/results/eden_gpt2_loss.md
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("ddp_adamw", "quant_uniform_2", "quant_eden_2", "quant_eden_1", "quant_qsgd_2")
LABELS = {
    "ddp_adamw": "DDP (fp32 all-reduce)",
    "quant_uniform_2": 'QuantDDPStrategy(codec="uniform", bits=2)',
    "quant_eden_2": 'QuantDDPStrategy(codec="eden", bits=2)',
    "quant_eden_1": 'QuantDDPStrategy(codec="eden", bits=1)',
    "quant_qsgd_2": 'QuantDDPStrategy(codec="qsgd", bits=2)',
}
# model -> (what the title names, what the description's first words name)
MODELS = {
    "demo": ("Lightning's demo transformer", "Lightning's demo `Transformer` (24,113-token vocabulary)"),
    "gpt2": (
        "a GPT-2 shape",
        "`transformers.GPT2LMHeadModel` (GPT-2's 50,257-token vocabulary, tied embeddings, 2 layers, 128 wide)",
    ),
}


def _steps(runs: dict) -> int:
    """The ``--steps`` all runs were made with (ValueError if they differ or one does not say)."""
    found = {v: re.search(r"--steps (\d+)", meta["command"]) for v, (meta, _) in runs.items()}
    steps = {v: int(m.group(1)) if m else None for v, m in found.items()}
    if len(set(steps.values())) != 1 or None in steps.values():
        raise ValueError(f"eden_demo_table: the runs must share one --steps, got {steps}")
    return next(iter(steps.values()))


def table(model: str) -> str:
    """The Markdown of ``benchmarks/results/eden_<model>_loss.md`` from the runs' JSON files."""
    if model not in MODELS:
        raise ValueError(f"eden_demo_table: model={model!r}, expected one of {sorted(MODELS)}")
    runs = {}
    for v in VARIANTS:
        path = RESULTS / f"eden_{model}_{v}.json"
        if path.exists():
            data = json.loads(path.read_text())
            runs[v] = (data["meta"], data["rows"][f"0/{v}"])
    if not runs:
        raise ValueError(f"eden_demo_table: no benchmarks/results/eden_{model}_<variant>.json for model={model!r}")
    steps = _steps(runs)
    title, what = MODELS[model]
    model_arg = "" if model == "demo" else f" --model {model}"
    base = runs["ddp_adamw"][1]["tail5"] if "ddp_adamw" in runs else None
    lines = [
        f"# QuantDDP with the eden codec on {title}: training loss",
        "",
        f"{what}, 2 gloo ranks on CPU, AdamW lr 1e-3, batch 8 x 32",
        f"tokens per rank, {steps} steps, seed 0, synthetic Zipf-bigram tokens (`benchmarks/onebit_vocab_convergence.py`);",
        "loss = training loss over the last 5 steps, mean of both ranks. One run per variant:",
        f"`OMP_NUM_THREADS=1 python benchmarks/onebit_vocab_convergence.py --model {model} --steps {steps} --seeds 0 "
        f"--variants <variant> --out benchmarks/results/eden_{model}_<variant>.json`, then "
        f"`python benchmarks/eden_demo_table.py{model_arg}`.",
        "",
        "| variant | method | loss | vs DDP | device | torch | commit | date (UTC) | seconds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v, (meta, row) in runs.items():
        gap = "-" if base is None else f"{(row['tail5'] / base - 1) * 100:+.1f}%"
        lines.append(
            f"| {v} | {LABELS[v]} | {row['tail5']:.4f} | {gap} | {meta.get('device', '?')} | {meta.get('torch', '?')} "
            f"| {meta.get('commit', '?')[:12]} | {meta['utc']} | {meta['seconds']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="demo")
    args = ap.parse_args()
    text = table(args.model)
    (RESULTS / f"eden_{args.model}_loss.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
