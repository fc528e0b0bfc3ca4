"""Saved-activation memory, peak memory, step time and loss with and without activation quantization (one process).

For each model (``bench``: the 3.3M-parameter GPT of ``bench_model.py`` on its Markov tokens; ``bytegpt``: the
demo ``ByteGPT`` on the stdlib bytes; ``gpt2`` / ``llama``: Hugging Face ``GPT2LMHeadModel`` (50,257-token
vocabulary) and ``LlamaForCausalLM`` (32,000) built from their configs at ``--hf-size`` (``gpu_e2e.SIZES``:
``cpu`` is GPT-2-small's 12 x 768 at 2 x 256 tokens, ``gpu`` 8 x 1024, ``paper`` 8 x 2048) on a Zipf bigram
token stream) and each setting (``fp32`` baseline, ``uniform`` 4-bit, ``layer_aware``
4-bit with 8-bit edges, ``budget`` 4/5/6/8 bits at a mean of 5), a fresh subprocess trains N AdamW steps from
the same seed on the same batches and reports:

* saved-activation bytes of one forward (peak: every save is alive when backward starts): the baseline
  counts every tensor autograd saves (``count_saved_tensors``); the quantized settings read the
  quantizer's counter (``SavedBytes.stored``), which counts the same saves, quantized ones at packed size;
* peak memory of one more training step after the loop (``peak_memory.peak_bytes``: the allocator's peak above
  the step's start, from CUDA's statistics or the CPU profiler's memory events; parameters, gradients and
  optimizer state exist before it, so this is what the step's activations, logits, loss and temporaries add);
* process peak-RSS growth over the training loop (``ru_maxrss`` after the loop minus before it: the
  allocator's view, includes the codec's temporaries, noisy);
* median step time (first 3 steps dropped; printed only with ``--timings``: on a shared machine two runs of the
  same computation differ by more than the effect) and the mean loss of the last 5 steps.

Bytes are reported in MiB (2^20 bytes) in every column.

    python benchmarks/activation_memory.py --steps 30            # both models, all settings
    python benchmarks/activation_memory.py --models bench --settings fp32,uniform --steps 10
    python benchmarks/activation_memory.py --from-json rows.json  # reprint a saved run's table (no training)
    python benchmarks/activation_memory.py --models gpt2,llama --settings fp32,uniform --steps 3   # HF, CPU size
    python benchmarks/activation_memory.py --models llama --hf-size paper --device cuda --bf16 --steps 300

The training loop calls ``ActivationQuantizer`` directly (what the Lightning callback runs around each
training forward); ``budget`` calibrates on step 0 and fixes its plan after that step's backward.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

SETTINGS = {
    "fp32": None,
    "fp32_seed1": None,  # the fp32 run from another seed (init and batch order): run-to-run spread yardstick
    "uniform": {"bits": 4, "policy": "uniform"},
    # 4-bit with every save inside attention modules (their Q/K/V and output projection inputs) kept exact
    "uniform_attn_exact": {"bits": 4, "policy": "uniform", "attention_patterns": ("*attn*", "*attention*")},
    "layer_aware": {"bits": 4, "policy": "layer_aware", "edge_bits": 8},
    "budget": {"bits": 4, "policy": "budget", "budget_bits": 5.0},
}
MODELS = ("bench", "bytegpt", "gpt2", "llama")
HF_MODELS = ("gpt2", "llama")


def _build(model: str, batch: int, seed: int = 0, hf_size: str = "cpu"):
    """(nn.Module, DataLoader of (x, y) batches on CPU) for ``model``, deterministic given ``seed``."""
    import torch

    torch.manual_seed(seed)
    if model in HF_MODELS:
        from gpu_e2e import SIZES, build_model
        from onebit_vocab_convergence import zipf_bigram_tokens

        class Logits(torch.nn.Module):  # the HF model called as net(x) -> logits, like the other models
            def __init__(self, hf: torch.nn.Module) -> None:
                super().__init__()
                self.hf = hf

            def forward(self, x):
                return self.hf(input_ids=x).logits

        size = SIZES[hf_size]
        net = Logits(build_model(model, hf_size))
        seq, vocab = size["seq"], size["vocab"][model]
        tokens = zipf_bigram_tokens(vocab, batch * 64 * (seq + 1), seed=seed).view(-1, seq + 1)
        data = torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:])
        loader = torch.utils.data.DataLoader(
            data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(seed)
        )
    elif model == "bench":
        from bench_model import GPT, MODEL_PRESETS, MarkovTokens

        cfg = MODEL_PRESETS["bench"]
        net = GPT(cfg)
        data = MarkovTokens(cfg.vocab_size, cfg.seq_len, n=batch * 64, seed=0)
        loader = torch.utils.data.DataLoader(
            data, batch_size=batch, shuffle=True, generator=torch.Generator().manual_seed(seed)
        )
    else:
        from lightning_qcomm.demo import ByteGPT, StdlibBytes

        net = ByteGPT(n_layer=4, n_head=4, n_embd=128, block_size=128)
        dm = StdlibBytes(block_size=128, batch_size=batch, max_bytes=1_000_000)
        dm.setup("fit")
        loader = torch.utils.data.DataLoader(
            dm.train_set, batch_size=batch, shuffle=True, drop_last=True, generator=torch.Generator().manual_seed(seed)
        )
    return net, loader


def run_one(
    model: str, setting: str, steps: int, batch: int, hf_size: str = "cpu", device: str = "cpu", bf16: bool = False
) -> dict:
    """Train ``steps`` steps in this process and return the measurements (see module docstring)."""
    import contextlib

    import torch
    import torch.nn.functional as F
    from peak_memory import peak_bytes

    from lightning_qcomm.memory import ActivationQuantConfig, ActivationQuantizer, count_saved_tensors

    torch.set_flush_denormal(True)
    net, loader = _build(model, batch, seed=1 if setting == "fp32_seed1" else 0, hf_size=hf_size)
    net = net.to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3)
    cfg = SETTINGS[setting]
    quantizer = None
    if cfg is not None:
        quantizer = ActivationQuantizer(ActivationQuantConfig(**cfg))
        quantizer.attach(net)
    autocast = (lambda: torch.autocast(torch.device(device).type, torch.bfloat16)) if bf16 else contextlib.nullcontext
    batches = iter(loader)
    losses, times, saved, baseline, quantized_ratio, avg_bits, coverage = [], [], 0, 0, 1.0, 32.0, 0.0

    def next_batch():
        nonlocal batches
        try:
            x, y = next(batches)
        except StopIteration:
            batches = iter(loader)
            x, y = next(batches)
        return x.to(device), y.to(device)

    def train_step(x, y, step):
        with quantizer.forward_context(step=step) if quantizer else count_saved_tensors() as counted, autocast():
            logits = net(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        del logits
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: the measured step's peak is its own
        loss.backward()
        if quantizer is not None and quantizer.config.policy == "budget" and quantizer.plan is None:
            quantizer.finish_calibration()
        opt.step()
        return float(loss.detach()), quantizer.stats if quantizer else counted

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for step in range(steps):
        x, y = next_batch()
        t0 = time.perf_counter()
        loss, stats = train_step(x, y, step)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        if step == steps - 1:  # the last forward: after calibration, the plan's widths
            saved, baseline = stats.stored, stats.baseline
            quantized_ratio, avg_bits = stats.quantized_ratio, stats.avg_bits if stats.quantized_numel else 32.0
            coverage = stats.coverage
    x, y = next_batch()
    peak, _ = peak_bytes(lambda: train_step(x, y, steps), device)
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "model": model,
        "setting": setting,
        "steps": steps,
        "batch": batch,
        "params": sum(p.numel() for p in net.parameters()),
        "saved_bytes": saved,
        "baseline_bytes": baseline,
        "quantized_ratio": quantized_ratio,
        "avg_bits": avg_bits,
        "rss_growth_kib": rss1 - rss0,
        "step_peak_bytes": peak,
        "coverage": coverage,
        "hf_size": hf_size if model in HF_MODELS else None,
        "device": device,
        "bf16": bf16,
        "step_s_median": statistics.median(times[3:] if len(times) > 3 else times),
        "final_loss": sum(losses[-5:]) / min(5, len(losses)),
        "first_loss": losses[0],
    }


def table(rows: list[dict], timings: bool = False) -> str:
    """Markdown table of result rows; bytes in MiB (2^20)."""
    mib = float(1 << 20)
    base = {r["model"]: r for r in rows if r["setting"] == "fp32"}
    head = "| model | setting | saved activations (MiB) | vs fp32 | covered | mean bits | step peak (MiB) | vs fp32 |"
    head += " peak RSS growth (MiB) |"
    head += " step time (s) |" if timings else ""
    lines = [head + " loss after N steps |", "|---" * (10 + timings) + "|"]
    for r in rows:
        b = base.get(r["model"])
        rel = f"{r['saved_bytes'] / b['saved_bytes']:.3f}" if b else "-"
        peak = r.get("step_peak_bytes")
        peak_rel = f"{peak / b['step_peak_bytes']:.3f}" if b and peak and b.get("step_peak_bytes") else "-"
        fp = r["setting"].startswith("fp32")
        bits = "-" if fp else f"{r['avg_bits']:.2f}"
        cov = "-" if fp else f"{r.get('coverage', float('nan')):.3f}"
        step = f" {r['step_s_median']:.3f} |" if timings else ""
        peak_mib = f"{peak / mib:.1f}" if peak else "-"
        lines.append(
            f"| {r['model']} ({r['params'] / 1e6:.2f}M) | {r['setting']} | {r['saved_bytes'] / mib:.2f} | {rel} | {cov}"
            f" | {bits} | {peak_mib} | {peak_rel} | {r['rss_growth_kib'] / 1024:.1f} |{step} {r['final_loss']:.4f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--from-json", default=None, help="print the table of rows saved by --json (no training)")
    p.add_argument("--timings", action="store_true", help="also print the median step time (quiet machine only)")
    p.add_argument("--hf-size", default="cpu", help="gpu_e2e.SIZES entry for the gpt2 / llama models")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (bf16-mixed), the loss in fp32")
    p.add_argument("--_one", default=None, help=argparse.SUPPRESS)  # internal: model:setting in this process
    a = p.parse_args()
    if a._one:
        model, setting = a._one.split(":")
        print(json.dumps(run_one(model, setting, a.steps, a.batch, a.hf_size, a.device, a.bf16)))
        return
    if a.from_json:
        rows = json.loads(Path(a.from_json).read_text())
        print(table(rows, a.timings))
        return
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for model in a.models.split(","):
        for setting in a.settings.split(","):
            if model not in MODELS or setting not in SETTINGS:
                raise ValueError(f"unknown model/setting {model!r}/{setting!r}; allowed {MODELS} / {tuple(SETTINGS)}")
            cmd = [
                sys.executable,
                __file__,
                "--_one",
                f"{model}:{setting}",
                "--steps",
                str(a.steps),
                "--batch",
                str(a.batch),
                "--hf-size",
                a.hf_size,
                "--device",
                a.device,
                *(["--bf16"] if a.bf16 else []),
            ]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            print(f"done {model}:{setting}", file=sys.stderr, flush=True)
    print(
        f"{a.steps} steps, batch {a.batch}, {a.device}{', bf16-mixed' if a.bf16 else ''}, HF size {a.hf_size}, "
        f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}"
    )
    print(table(rows, a.timings))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
