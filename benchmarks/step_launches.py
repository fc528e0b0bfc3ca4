"""Launches per training step on the CUDA path, counted on CPU: plain DDP against DDP with QuantDDP's hook.

A GPU step that launches many more kernels than DDP's is bound by the host (a launch costs the host some
microseconds whatever the kernel does). This counts, per optimizer step of a GPT-2-small-shaped model, what
``benchmarks/launch_counts.py`` counts for one collective: the codec ops' CUDA kernels run on CPU tensors through
Triton's interpreter (``cuda_path_on_cpu``: Triton launches), plus the aten ops a ``TorchDispatchMode`` sees less
allocations and views, plus the collectives.

* Model: Hugging Face ``GPT2LMHeadModel`` from a config (no download), GPT-2 small's 12 layers and tied
  embeddings with the widths (embedding, positions, vocabulary) times ``--scale`` s, so its tensors are GPT-2
  small's 148 and DDP's bucket cap is 25 MB times s^2 (the full model's buckets at s = 1: the counts depend on
  the tensors and the buckets, not on the widths). fp32, batch 1 x 32 tokens.
* Ranks: torch's fake process group of N ranks in one process, its all-to-all and all-gather mirrored (every rank
  holds this rank's rows: finite values, so the step's non-finite check passes as on a real run).
* DDP: ``DistributedDataParallel(bucket_cap_mb=25 s^2)`` with its all-reduce as a hook (``all_reduce`` and the
  division by N, as DDP's own: the collective is seen from Python; one NCCL kernel per bucket on a GPU) against
  ``quant_ddp_hook(QuantDDPConfig(codec, bits, overlap_comm=False))`` (a GPU runs the bucket inline).
* Step: forward, loss, backward, ``AdamW(foreach=True).step()``, ``zero_grad()``; counted after two warm-up
  steps (the hook's first call checks the ranks' agreement; not per step).

What the figures are: the hook's Triton and torch launches are the CUDA path's own (the same kernels, run on CPU);
the model's and the optimizer's are the CPU's aten ops, a proxy for their CUDA launches (one op is about one
kernel; cuBLAS and fused attention are one op either way; a ``_foreach_*`` op is one op here and about one
kernel per 24 tensors on CUDA). So the ratio is a proxy for the GPU's; the difference between the two columns (the
launches the hook adds) is exact for this model's buckets.

    OMP_NUM_THREADS=1 python benchmarks/step_launches.py --scale 0.125 --world 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # before torch or triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = {  # name -> (codec, bits) of QuantDDPConfig; None: DDP's all-reduce
    "ddp": None,
    "uniform-8": ("uniform", 8),
    "fp8_e4m3": ("fp8_e4m3", 8),
    "nuqsgd-4": ("nuqsgd", 4),
}
BUCKET_MB = 25.0  # DDP's default bucket_cap_mb


def gpt2(scale: float):
    """GPT-2 small's tensors with the widths times ``scale`` (fp32, eval-free: dropout 0)."""
    import transformers

    heads = 12
    width = max(heads, round(768 * scale / heads) * heads)
    config = transformers.GPT2Config(
        n_embd=width,
        n_layer=12,
        n_head=heads,
        vocab_size=max(64, round(50257 * scale)),
        n_positions=max(64, round(1024 * scale)),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _allreduce_hook(state, bucket):  # no annotation: DDP compares it with the class, not a string
    """DDP's own all-reduce of a bucket as a hook (torch's ``allreduce_hook`` reads a result the fake group does not
    set): the sum in place, then the division by N, as DDP divides."""
    import torch.distributed as dist

    buffer = bucket.buffer()
    dist.all_reduce(buffer)
    buffer.div_(dist.get_world_size())
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buffer)
    return fut


def count_step(method: str, scale: float, world: int, log: list[str]) -> dict:
    """Launches of one training step of ``method`` (see the module docstring), by part."""
    import torch.distributed as dist
    from launch_counts import Launches
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_qcomm.adapters.ddp.config import QuantDDPConfig
    from lightning_qcomm.parallel import quant_ddp_hook

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    model = gpt2(scale)
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB * scale**2)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, foreach=True)
    if METHODS[method] is None:
        state, hook = None, _allreduce_hook
    else:
        codec, bits = METHODS[method]
        state, hook = quant_ddp_hook(QuantDDPConfig(codec=codec, bits=bits, overlap_comm=False), ddp, optimizer=opt)
    calls = []

    def counted(state, bucket):  # the buckets of a step: the hook's calls
        calls.append(bucket.index())
        return hook(state, bucket)

    ddp.register_comm_hook(state, counted)
    tokens = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))

    def step() -> None:
        loss = ddp(tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    step()
    step()
    log.clear()
    calls.clear()
    with Launches() as mode:
        step()
    buckets = len(calls)
    dist.destroy_process_group()
    c = {"triton": len(log), "torch": len(mode.torch_ops), "collectives": len(mode.collectives)}
    return {"method": method, "world": world, "buckets": buckets, **c, "total": sum(c.values())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=0.125, help="width factor (DDP's bucket cap: its square)")
    parser.add_argument("--world", type=int, default=4, help="ranks of the fake process group")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods {','.join(unknown)}: unknown; allowed: {', '.join(METHODS)}")
    from launch_counts import cuda_path_on_cpu, mirrored_collectives

    with cuda_path_on_cpu() as log, mirrored_collectives():
        rows = [count_step(m, args.scale, args.world, log) for m in ["ddp", *[m for m in methods if m != "ddp"]]]
    base = rows[0]["total"]
    print(
        f"One training step, GPT-2 small's tensors x{args.scale} (DDP buckets of {BUCKET_MB * args.scale**2:.3g} MB), "
        f"N = {args.world} (fake group), torch {torch.__version__}; CUDA path on CPU tensors, Triton interpreted\n"
    )
    print("| method | buckets | Triton | torch | collectives | total | vs DDP | added per bucket |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        added = (r["total"] - base) / r["buckets"]
        print(
            f"| {r['method']} | {r['buckets']} | {r['triton']} | {r['torch']} | {r['collectives']} | {r['total']} "
            f"| {r['total'] / base:.3f}x | {added:+.1f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
