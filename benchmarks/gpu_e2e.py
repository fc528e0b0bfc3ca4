"""End to end on one GPU: the step of every strategy and callback against plain DDP's, on the models users train.

    python -m benchmarks.gpu_e2e                       # one GPU: GPT-2-small and LLaMA-style shapes, bf16-mixed, 8 x 1024
    python -m benchmarks.gpu_e2e --size tiny           # the same code on CPU at a tiny size (the suite runs it)
    python -m benchmarks.gpu_e2e --models llama --methods ddp,qddp_uniform8 --budget-s 120

On one device nothing travels, so whatever a method adds to the step is pure overhead that every multi-GPU run
pays too. Each (model, method) trains in a process of its own with Lightning's ``Trainer(devices=1)`` on random
tokens (timing only): ``--warmup`` steps, then ``--steps`` timed steps (CUDA events around each step, median),
then ``--profile-steps`` steps whose kernel launches are counted (the profiler's ``cudaLaunchKernel`` /
``cuLaunchKernel`` calls; on CPU the aten ops a dispatch mode sees, a launch's proxy). Peak memory is
``torch.cuda.max_memory_allocated`` over the fit (not measured on CPU). Each row's ratio is against DDP in the
same run, QSDP's against FSDP2's own collectives in QSDP's groups (``QSDPStrategy(bits=32)``).

Models (Hugging Face ``transformers`` classes built from a config, no download): GPT-2 small (12 x 768, 50,257
tokens, tied embeddings) and a LLaMA-style one (12 x 768, SwiGLU 2048, RMSNorm, rotary, 32,000 tokens).
Writes ``benchmarks/results/gpu_e2e.{md,json}`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    "gpu": dict(layers=12, width=768, heads=12, ffn=2048, batch=8, seq=1024, vocab={"gpt2": 50257, "llama": 32000}),
    # activation_memory.py: GPT-2-small's dimensions at a CPU's token count, and AGoQ's LLaMA setting
    "cpu": dict(layers=12, width=768, heads=12, ffn=2048, batch=2, seq=256, vocab={"gpt2": 50257, "llama": 32000}),
    "paper": dict(layers=12, width=768, heads=12, ffn=2048, batch=8, seq=2048, vocab={"gpt2": 50257, "llama": 32000}),
    "cpu_small": dict(layers=4, width=256, heads=4, ffn=688, batch=4, seq=256, vocab={"gpt2": 50257, "llama": 32000}),
    "tiny": dict(layers=2, width=64, heads=4, ffn=128, batch=2, seq=32, vocab={"gpt2": 1000, "llama": 1000}),
}
METHODS = {  # name -> (what it is, the row it is compared with)
    "ddp": ("DDP", None),
    "qddp_uniform8": ("QuantDDPStrategy(codec='uniform', bits=8)", "ddp"),
    "qddp_fp8": ("QuantDDPStrategy(codec='fp8_e4m3')", "ddp"),
    "qddp_nuqsgd4": ("QuantDDPStrategy(codec='nuqsgd', bits=4)", "ddp"),
    "qddp_auto": ("QuantDDPStrategy(codec='auto'), its trial steps included", "ddp"),
    "fsdp2": ("QSDPStrategy(bits=32): FSDP2's own collectives in QSDP's groups", None),
    "qsdp_w8g8": ("QSDPStrategy(bits=8)", "fsdp2"),
    "local_sgd": ("LocalSGDStrategy(sync='constant', period=4)", "ddp"),
    "onebit_adam": ("DDP + OneBitAdamCallback(freeze_step=2), timed after the freeze", "ddp"),
    "actq4": ("DDP + ActivationQuantization(bits=4)", "ddp"),
}
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")


def build_model(kind: str, size: str):
    """A Hugging Face causal LM of ``kind`` ("gpt2" or "llama") at ``size``, from its config (no download)."""
    import transformers

    s = SIZES[size]
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=s["vocab"]["gpt2"],
            n_positions=s["seq"],
            n_embd=s["width"],
            n_layer=s["layers"],
            n_head=s["heads"],
        )
        return transformers.GPT2LMHeadModel(cfg)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=s["vocab"]["llama"],
            hidden_size=s["width"],
            intermediate_size=s["ffn"],
            num_hidden_layers=s["layers"],
            num_attention_heads=s["heads"],
            num_key_value_heads=s["heads"],
            max_position_embeddings=s["seq"],
        )
        return transformers.LlamaForCausalLM(cfg)
    raise ValueError(f"build_model(kind={kind!r}) is not supported; allowed: gpt2, llama")


def _strategy_and_callbacks(method: str):
    from lightning_qcomm import (
        ActivationQuantization,
        LocalSGDStrategy,
        OneBitAdamCallback,
        QSDPStrategy,
        QuantDDPStrategy,
    )

    make = {
        "ddp": lambda: ("ddp", []),
        "qddp_uniform8": lambda: (QuantDDPStrategy(codec="uniform", bits=8), []),
        "qddp_fp8": lambda: (QuantDDPStrategy(codec="fp8_e4m3"), []),
        "qddp_nuqsgd4": lambda: (QuantDDPStrategy(codec="nuqsgd", bits=4), []),
        "qddp_auto": lambda: (QuantDDPStrategy(codec="auto"), []),
        "fsdp2": lambda: (QSDPStrategy(bits=32), []),
        "qsdp_w8g8": lambda: (QSDPStrategy(bits=8), []),
        "local_sgd": lambda: (LocalSGDStrategy(sync="constant", period=4), []),
        "onebit_adam": lambda: ("ddp", [OneBitAdamCallback(freeze_step=2)]),
        "actq4": lambda: ("ddp", [ActivationQuantization(bits=4)]),
    }
    if method not in make:
        raise ValueError(f"gpu_e2e(method={method!r}) is not supported; allowed: {', '.join(make)}")
    return make[method]()


def run_one(kind: str, method: str, size: str, warmup: int, steps: int, profile_steps: int) -> dict[str, Any]:
    """Train ``kind`` under ``method`` in this process; the measurements as a dict."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    cuda = torch.cuda.is_available()
    s = SIZES[size]
    total = warmup + steps + profile_steps

    class CausalLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = build_model(kind, size)

        def training_step(self, batch, batch_idx):
            loss = self.model(input_ids=batch, labels=batch).loss
            self.last_loss = loss.detach()
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    class Measure(pl.Callback):
        def __init__(self) -> None:
            self.events: list = []
            self.counted = 0
            self.counter = None

        def on_train_start(self, trainer, pl_module) -> None:
            if cuda:
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            if warmup <= batch_idx < warmup + steps:
                self.events.append(_stamp(cuda))
            elif batch_idx == warmup + steps:
                self.counter = _LaunchCounter(cuda)
                self.counter.__enter__()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if warmup <= batch_idx < warmup + steps:
                self.events.append(_stamp(cuda))
            elif batch_idx == total - 1 and self.counter is not None:
                self.counter.__exit__(None, None, None)
                self.counted = self.counter.count

    torch.manual_seed(0)
    data = torch.randint(0, s["vocab"][kind], (total * s["batch"], s["seq"]))
    loader = DataLoader(data, batch_size=s["batch"])
    strategy, callbacks = _strategy_and_callbacks(method)
    measure = Measure()
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed" if cuda else "32-true",
        max_steps=total,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[measure, *callbacks],
    )
    model = CausalLM()
    trainer.fit(model, loader)
    if cuda:
        torch.cuda.synchronize()
    starts, ends = measure.events[0::2], measure.events[1::2]
    times = [_elapsed_ms(a, b, cuda) for a, b in zip(starts, ends)]
    return {
        "model": kind,
        "method": method,
        "params_m": sum(p.numel() for p in model.model.parameters()) / 1e6,
        "step_ms": statistics.median(times),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "launches_per_step": measure.counted / profile_steps,
        "launch_unit": "CUDA kernel launches" if cuda else "aten ops (CPU)",
        "loss": float(model.last_loss),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
    }


def _stamp(cuda: bool):
    import torch

    if cuda:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _elapsed_ms(a, b, cuda: bool) -> float:
    return a.elapsed_time(b) if cuda else (b - a) * 1e3


class _LaunchCounter:
    """Kernel launches (CUDA: the profiler's launch calls) or dispatched aten ops (CPU) while entered."""

    def __init__(self, cuda: bool) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.cuda, self.count = cuda, 0
        if cuda:
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.ctx = torch.profiler.profile(activities=acts)
        else:
            outer = self

            class Ops(TorchDispatchMode):
                def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                    outer.count += 1
                    return func(*args, **(kwargs or {}))

            self.ctx = Ops()

    def __enter__(self):
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.ctx.__exit__(*exc)
        if self.cuda:
            self.count = sum(e.count for e in self.ctx.key_averages() if e.key in LAUNCHES)


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """A markdown table: per model, each method's median step, its ratio to the baseline row, peak, launches."""
    first = next((r for r in rows if "step_ms" in r), {})
    lines = [
        "# End to end on one device",
        "",
        f"Command: `python -m benchmarks.gpu_e2e --size {args.size} --warmup {args.warmup} --steps {args.steps}`; "
        f"device: {first.get('device', '?')}, torch {first.get('torch', '?')}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.",
        f"Median step of {args.steps} after {args.warmup} warm-up steps; launches per step over {args.profile_steps} more "
        f"({first.get('launch_unit', '')}); ratio against the row named in 'vs'.",
        "",
        "| model | method | params (M) | step ms | vs | ratio | peak GiB | launches / step | loss |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    by = {(r["model"], r["method"]): r for r in rows}
    for r in sorted(rows, key=lambda r: r["model"]):  # stable: each model's rows in the order they ran
        if "step_ms" not in r:
            lines.append(f"| {r['model']} | {r['method']} | | | | | | | failed: {r.get('error', '')[:120]} |")
            continue
        base_name = METHODS[r["method"]][1]
        base = by.get((r["model"], base_name), {})
        ratio = f"{r['step_ms'] / base['step_ms']:.2f}x" if "step_ms" in base else ""
        peak = "" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        lines.append(
            f"| {r['model']} | {r['method']} | {r['params_m']:.1f} | {r['step_ms']:.1f} | {base_name or ''} | {ratio} "
            f"| {peak} | {r['launches_per_step']:.0f} | {r['loss']:.3f} |"
        )
    lines += ["", *[f"- `{m}`: {what}" for m, (what, _) in METHODS.items()]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=tuple(SIZES), default="gpu")
    p.add_argument("--models", default="gpt2,llama")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--budget-s", type=float, default=330.0, help="stop starting new runs after this many seconds")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_e2e"))
    p.add_argument("--one", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        row = run_one(*args.one, args.size, args.warmup, args.steps, args.profile_steps)
        print("GPU_E2E_ROW " + json.dumps(row))
        return [row]
    start, rows = time.monotonic(), []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    for method in args.methods.split(","):  # method by method, so a budget cut leaves whole comparisons
        for kind in args.models.split(","):
            left = args.budget_s - (time.monotonic() - start)
            if left <= 0:
                rows.append({"model": kind, "method": method, "error": "not run: out of the time budget"})
                continue
            cmd = [sys.executable, "-m", "benchmarks.gpu_e2e", "--one", kind, method, "--size", args.size]
            cmd += [
                "--warmup",
                str(args.warmup),
                "--steps",
                str(args.steps),
                "--profile-steps",
                str(args.profile_steps),
            ]
            try:
                proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=max(left, 30))
                found = [ln for ln in proc.stdout.splitlines() if ln.startswith("GPU_E2E_ROW ")]
                row = json.loads(found[-1][len("GPU_E2E_ROW ") :]) if found else None
                error = (proc.stderr or proc.stdout)[-600:]
            except subprocess.TimeoutExpired:
                row, error = None, "timed out"
            rows.append(row or {"model": kind, "method": method, "error": error.replace("\n", " ")})
            print(f"gpu_e2e: {kind} {method}: " + (f"{row['step_ms']:.1f} ms" if row else "FAILED"), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    text = report(rows, args)
    out.with_suffix(".md").write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
