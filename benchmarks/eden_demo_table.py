"""The loss table of QuantDDP with the ``eden`` codec on Lightning's demo transformer, from the JSON files that
``benchmarks/onebit_vocab_convergence.py`` wrote (one run per variant: ``--model demo --steps 160 --seeds 0
--variants <v> --out benchmarks/results/eden_demo_<v>.json``), into ``benchmarks/results/eden_demo_loss.md``.

Each row: the training loss over the last 5 steps (mean of the 2 ranks; seed 0), and its gap to DDP's (the
``ddp_adamw`` run), with the run's device, torch, commit and date from its JSON.

    python benchmarks/eden_demo_table.py
"""

from __future__ import annotations

import json
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


def main() -> None:
    runs = {}
    for v in VARIANTS:
        path = RESULTS / f"eden_demo_{v}.json"
        if path.exists():
            data = json.loads(path.read_text())
            runs[v] = (data["meta"], data["rows"][f"0/{v}"])
    base = runs["ddp_adamw"][1]["tail5"] if "ddp_adamw" in runs else None
    lines = [
        "# QuantDDP with the eden codec on Lightning's demo transformer: training loss",
        "",
        "Lightning's demo `Transformer` (24,113-token vocabulary), 2 gloo ranks on CPU, AdamW lr 1e-3, batch 8 x 32",
        "tokens per rank, 160 steps, seed 0, synthetic Zipf-bigram tokens (`benchmarks/onebit_vocab_convergence.py`);",
        "loss = training loss over the last 5 steps, mean of both ranks. One run per variant:",
        "`OMP_NUM_THREADS=1 python benchmarks/onebit_vocab_convergence.py --model demo --steps 160 --seeds 0 "
        "--variants <variant> --out benchmarks/results/eden_demo_<variant>.json`, then "
        "`python benchmarks/eden_demo_table.py`.",
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
    (RESULTS / "eden_demo_loss.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
