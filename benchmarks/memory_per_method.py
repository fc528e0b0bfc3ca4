"""Memory per rank of every method against its baseline, in bytes per parameter: what stays and what a step adds.

Model: Hugging Face ``GPT2LMHeadModel`` built from a config (no download; ``step_launches.gpt2``): GPT-2 small's
12 layers and tied embeddings with the widths (embedding, positions, vocabulary) times ``--scale``; fp32, batch
2 x 64 tokens. Each method runs in fresh processes, N gloo ranks on the CPU (``--world``, default 2), for
``--steps`` training steps (forward, loss, backward, the optimizer's step, ``zero_grad()``; ``step_methods``),
the first ``--warmup`` uncounted. Per rank, in bytes per model parameter (the larger of the ranks):

* **live after**: the tensor bytes alive after the last step (``tensor_memory.TensorMemory``: every storage made
  from the model's construction on, C++-held ones included, DDP's buckets among them), split into parameters,
  gradients, optimizer state and the rest (the method's own state: error buffers, snapshots, DDP's buckets);
* **peak**: the most tensor bytes alive at once during the counted steps (persistent state + a step's transients).

``above`` columns are the method's figure less its baseline's (DDP + AdamW; FSDP2 for QSDP). On a GPU
(``--device cuda``, NCCL) the same columns come from ``torch.cuda.memory_allocated`` after the run and
``max_memory_allocated`` over the counted steps (the allocator's bytes: its rounding and kernels' workspaces too).

Methods (``METHODS``; each with its library defaults unless named): ``ddp`` (DDP + AdamW, the bucket cap 25 MB
x s²); ``uniform-8`` and ``nuqsgd-4-ef`` (``quant_ddp_hook(QuantDDPConfig(...))``, the second with
``error_feedback=True``); ``onebit-adam`` (``OneBitAdam(freeze_step=2)`` through ``onebit_adam_ddp``, buckets of
32 MB x s²; counted after the freeze; ``onebit-adam-inline``: ``overlap=False``, the form a GPU runs);
``local-sgd-qsr`` (``LocalSGD(LocalSGDConfig(sync="qsr", h_base=4,
warmup_steps=1000))``: H = 4, so the counted steps include averages); ``fsdp2`` (``fully_shard`` on QSDP's grouping),
``qsdp-w8g8`` / ``qsdp-w4g4`` (``apply_qsdp(QSDPConfig(bits=8 | 4))``); ``actq-4`` (DDP + AdamW with
``ActivationQuantizer(bits=4)``).

    OMP_NUM_THREADS=1 python benchmarks/memory_per_method.py --scale 0.25
    OMP_NUM_THREADS=1 python benchmarks/memory_per_method.py --methods ddp,onebit-adam --json /tmp/rows.json
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import step_methods as sm  # noqa: E402

BATCH, SEQ = 2, 64


def _quant_ddp(model, tokens, scale, world, **config):
    from lightning_qcomm.adapters.ddp.config import QuantDDPConfig

    return sm.ddp_hooked(model, tokens, scale, world, config=QuantDDPConfig(**config))


def _onebit(model, tokens, scale, world, overlap=True):
    from lightning_qcomm.optim import OneBitAdam
    from lightning_qcomm.parallel import onebit_adam_ddp

    net = sm.ddp(model, scale)
    opt = OneBitAdam(net.parameters(), lr=1e-4, freeze_step=2, bucket_mb=32.0 * scale**2, overlap=overlap)
    onebit_adam_ddp(net, opt)
    return sm.Run(sm.train_step(net, tokens, opt))


def _local_sgd_qsr(model, tokens, scale, world):
    from lightning_qcomm.parallel import LocalSGD, LocalSGDConfig

    opt = sm.adamw(model.parameters())
    config = LocalSGDConfig(sync="qsr", h_base=4, warmup_steps=1000, comm_bucket_mb=sm.BUCKET_MB * scale**2)
    LocalSGD(model, opt, config)
    return sm.Run(sm.train_step(model, tokens, opt))


def _fsdp(model, tokens, scale, world, bits=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from lightning_qcomm.parallel import QSDPConfig, apply_qsdp
    from lightning_qcomm.parallel.sharding import plan_fsdp_groups

    mesh = init_device_mesh(model.device.type if hasattr(model, "device") else "cpu", (world,))
    config = QSDPConfig(bits=bits or 8)
    if bits is not None:
        handle = apply_qsdp(model, mesh, config)
    else:
        for module in plan_fsdp_groups(model, config.layer_class_set, config.min_wrap_numel):
            fully_shard(module, mesh=mesh)
    opt = sm.adamw(model.parameters())
    if bits is not None:
        handle.attach(opt)
    return sm.Run(sm.train_step(model, tokens, opt))


METHODS = {  # name -> (baseline, builder(model, tokens, scale, world) -> step_methods.Run)
    "ddp": (None, sm.ddp_hooked),
    "uniform-8": ("ddp", partial(_quant_ddp, codec="uniform", bits=8)),
    "nuqsgd-4-ef": ("ddp", partial(_quant_ddp, codec="nuqsgd", bits=4, error_feedback=True)),
    "onebit-adam": ("ddp", _onebit),
    "onebit-adam-inline": ("ddp", partial(_onebit, overlap=False)),
    "local-sgd-qsr": ("ddp", _local_sgd_qsr),
    "actq-4": ("ddp", sm.activation_quant),
    "fsdp2": (None, _fsdp),
    "qsdp-w8g8": ("fsdp2", partial(_fsdp, bits=8)),
    "qsdp-w4g4": ("fsdp2", partial(_fsdp, bits=4)),
}


def _optimizer_of(run: sm.Run) -> torch.optim.Optimizer | None:
    """The optimizer the step closure trains with (``step_methods.train_step`` closes over it)."""
    for cell in run.step.__closure__ or ():
        if isinstance(cell.cell_contents, torch.optim.Optimizer):
            return cell.cell_contents
    return None


def _measure(rank: int, method: str, scale: float, world: int, steps: int, warmup: int, device: str) -> dict:
    """One rank's figures for ``method`` (module docstring), in bytes (not per parameter)."""
    from step_launches import gpt2
    from tensor_memory import TensorMemory, owners

    from lightning_qcomm.comm.comm_worker import CommWorker

    cuda = device == "cuda"
    mem = TensorMemory()
    run_one = CommWorker._run_one

    def counted(fn, fut):  # a comm worker's allocations count too
        with mem.in_thread():
            run_one(fn, fut)

    CommWorker._run_one = staticmethod(counted)
    with mem if not cuda else _nothing():
        model = gpt2(scale).to(device)
        tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))
        tokens = tokens.to(device)
        run = METHODS[method][1](model, tokens, scale, world)
        for _ in range(warmup):
            run.step()
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            mem.mark()
        for _ in range(steps - warmup):
            run.step()
        gc.collect()
    opt = _optimizer_of(run)
    if cuda:
        torch.cuda.synchronize()
        live, peak = torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
        by = {"other": live}
    else:
        live, peak = mem.live, mem.peak
        by = mem.by_owner(owners(model, opt))
    return {"live": live, "peak": peak, "owners": by, "params": sum(p.numel() for p in gpt2(scale).parameters())}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _rank(rank: int, world: int, port: int, args: dict, outfile: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "nccl" if args["device"] == "cuda" else "gloo"
    if args["device"] == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        row = _measure(rank, args["method"], args["scale"], world, args["steps"], args["warmup"], args["device"])
        Path(f"{outfile}.{rank}").write_text(json.dumps(row))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def run_method(method: str, scale: float, world: int, steps: int, warmup: int, device: str) -> dict:
    """``method``'s row: the larger figure of the ranks, bytes per parameter."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = {"method": method, "scale": scale, "steps": steps, "warmup": warmup, "device": device}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row")
        mp.spawn(_rank, args=(world, port, args, out), nprocs=world)
        ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    n = ranks[0]["params"]
    keys = sorted({k for r in ranks for k in r["owners"]})
    return {
        "method": method,
        "baseline": METHODS[method][0],
        "params": n,
        "live": max(r["live"] for r in ranks) / n,
        "peak": max(r["peak"] for r in ranks) / n,
        "owners": {k: max(r["owners"].get(k, 0) for r in ranks) / n for k in keys},
    }


def _meta(args: argparse.Namespace) -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=HERE.parent, capture_output=True, text=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores), gloo"
    return {
        "device": device,
        "torch": torch.__version__,
        "commit": commit.stdout.strip(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "world": args.world,
        "scale": args.scale,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch": f"{BATCH} x {SEQ} tokens",
        "counter": "torch.cuda allocator" if args.device == "cuda" else "tensor_memory.TensorMemory (per storage)",
    }


def table(rows: list[dict], meta: dict) -> str:
    """Markdown: the header line and one row per method, bytes per parameter."""
    by = {r["method"]: r for r in rows}
    head = (
        f"GPT-2 shape x{meta['scale']} ({rows[0]['params'] / 1e6:.2f}M parameters), {meta['batch']}, "
        f"N = {meta['world']}, {meta['device']}, torch {meta['torch']}, commit {meta['commit']}, {meta['date']}; "
        f"{meta['steps']} steps, the first {meta['warmup']} uncounted; counter: {meta['counter']}. "
        "Bytes per parameter per rank (the larger rank).\n\n"
    )
    lines = [
        "| method | baseline | live after | above baseline | params | grads | optimizer state | other | peak "
        "| peak above baseline |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        base = by.get(r["baseline"]) if r["baseline"] else None
        o = r["owners"]
        above = f"{r['live'] - base['live']:+.2f}" if base else "—"
        peak_above = f"{r['peak'] - base['peak']:+.2f}" if base else "—"
        lines.append(
            f"| {r['method']} | {r['baseline'] or '—'} | {r['live']:.2f} | {above} | {o.get('parameters', 0):.2f} "
            f"| {o.get('gradients', 0):.2f} | {o.get('optimizer state', 0):.2f} | {o.get('other', 0):.2f} "
            f"| {r['peak']:.2f} | {peak_above} |"
        )
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scale", type=float, default=0.25, help="width factor of GPT-2 small's tensors")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--out", default=str(HERE / "results" / "memory_per_method"), help="writes OUT.json and OUT.md")
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        p.error(f"--methods {','.join(unknown)}: unknown; allowed: {', '.join(METHODS)}")
    wanted = [m for m in METHODS if m in methods or any(METHODS[x][0] == m for x in methods)]
    rows = []
    for m in wanted:
        rows.append(run_method(m, args.scale, args.world, args.steps, args.warmup, args.device))
        print(f"done {m}", file=sys.stderr, flush=True)
    meta = _meta(args)
    text = table(rows, meta)
    print(text)
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(text)
    return rows


if __name__ == "__main__":
    main()
