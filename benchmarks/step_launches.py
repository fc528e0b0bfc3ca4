"""Launches per training step on the CUDA path, counted on CPU: each method of lightning_qcomm against its baseline.

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
* Methods (``METHODS``: name -> baseline, builder; the builders are in ``step_methods.py``, one per method):
  - ``ddp``: ``DistributedDataParallel(bucket_cap_mb=25 s^2)`` with its all-reduce as a hook (``all_reduce`` and
    the division by N, as DDP's own: the collective is seen from Python; one NCCL kernel per bucket on a GPU);
  - ``uniform-8``, ``fp8_e4m3``, ``nuqsgd-4``: DDP with ``quant_ddp_hook(QuantDDPConfig(codec, bits,
    overlap_comm=False))`` (a GPU runs the bucket inline); baseline ``ddp``;
  - ``onebit-adam``: DDP with ``OneBitAdam`` / ``onebit_adam_ddp`` after the freeze; baseline ``ddp`` (AdamW);
  - ``local-sgd``: ``LocalSGD`` (constant H = 8), a step without averaging; ``local-sgd-period``: the 8 steps of
    one period, the last averaging, per step (the amortised cost); baseline ``ddp``;
  - ``fsdp2``: plain FSDP2 ``fully_shard`` on QSDP's groups; ``qsdp-w8g8``: ``apply_qsdp`` with 8-bit weights and
    gradients; baseline ``fsdp2``;
  - ``actq-4``: DDP with ``ActivationQuantizer(bits=4)`` on the model; baseline ``ddp``.
* Step: forward, loss, backward, the optimizer's step (``AdamW(foreach=True)`` but for 1-bit Adam), ``zero_grad()``;
  counted after the method's warm-up steps (two, unless it needs more: the first calls check the ranks'
  agreement and build layouts; not per step).

What the figures are: the hook's Triton and torch launches are the CUDA path's own (the same kernels, run on CPU);
the model's and the optimizer's are the CPU's aten ops, a proxy for their CUDA launches (one op is about one
kernel; cuBLAS and fused attention are one op either way; a ``_foreach_*`` op is one op here and about one
kernel per 24 tensors on CUDA). So the ratio is a proxy for the GPU's; the difference from the baseline (the
launches the method adds) is exact for this model where the method's own ops are the CUDA path's. ``--by-caller``
also prints, per method, its torch launches and collectives by caller (``step_methods.caller``) and what differs
from its baseline.

    OMP_NUM_THREADS=1 python benchmarks/step_launches.py --scale 0.0625 --world 4
    OMP_NUM_THREADS=1 python benchmarks/step_launches.py --scale 0.0625 --world 4 --methods onebit-adam --by-caller
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from functools import partial
from pathlib import Path

if __name__ == "__main__":  # before torch or triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_methods as sm  # noqa: E402


def _quant_ddp(codec: str, bits: int):
    def build(model, tokens, scale, world):
        from lightning_qcomm.adapters.ddp.config import QuantDDPConfig

        return sm.ddp_hooked(
            model, tokens, scale, world, config=QuantDDPConfig(codec=codec, bits=bits, overlap_comm=False)
        )

    return build


METHODS = {  # name -> (baseline, builder(model, tokens, scale, world) -> step_methods.Run); baselines first
    "ddp": (None, sm.ddp_hooked),
    "fsdp2": (None, sm.fsdp),
    "uniform-8": ("ddp", _quant_ddp("uniform", 8)),
    "fp8_e4m3": ("ddp", _quant_ddp("fp8_e4m3", 8)),
    "nuqsgd-4": ("ddp", _quant_ddp("nuqsgd", 4)),
    "onebit-adam": ("ddp", sm.onebit_adam),
    "local-sgd": ("ddp", sm.local_sgd),
    "local-sgd-period": ("ddp", partial(sm.local_sgd, averaging=True)),
    "qsdp-w8g8": ("fsdp2", partial(sm.fsdp, qsdp=True)),
    "actq-4": ("ddp", sm.activation_quant),
}


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


def count_step(method: str, scale: float, world: int, log: list[str], build=None) -> dict:
    """Launches per step of ``method`` (see the module docstring), by part and by caller; ``build``: the
    builder to use instead of ``METHODS[method]``'s."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    model = gpt2(scale)
    tokens = torch.randint(0, model.config.vocab_size, (1, 32), generator=torch.Generator().manual_seed(1))
    run = (build or METHODS[method][1])(model, tokens, scale, world)
    if run.warm is not None:
        run.warm()
    for _ in range(0 if run.warm else run.warmup):
        run.step()
    log.clear()
    if run.hook_calls is not None:
        run.hook_calls.clear()
    with sm.Attributed() as mode:
        for _ in range(run.steps):
            run.step()
    dist.destroy_process_group()
    n = run.steps
    c = {"triton": len(log) / n, "torch": len(mode.torch_ops) / n, "collectives": len(mode.collectives) / n}
    by_caller = {k: v / n for k, v in mode.by_caller.most_common()}
    for name, k in sorted(Counter(log).items()):
        by_caller[f"Triton {name}"] = k / n
    buckets = None if run.hook_calls is None else len(run.hook_calls) / n
    return {"method": method, "world": world, "buckets": buckets, **c, "total": sum(c.values()), "by_caller": by_caller}


def _num(x: float) -> str:
    return f"{x:,.0f}" if x == int(x) else f"{x:,.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=0.0625, help="width factor (DDP's bucket cap: its square)")
    parser.add_argument("--world", type=int, default=4, help="ranks of the fake process group")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    parser.add_argument("--by-caller", action="store_true", help="also the launches by caller against the baseline")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods {','.join(unknown)}: unknown; allowed: {', '.join(METHODS)}")
    wanted = {METHODS[m][0] or m for m in methods} | set(methods)
    from launch_counts import cuda_path_on_cpu, mirrored_collectives

    with cuda_path_on_cpu() as log, mirrored_collectives():
        rows = {m: count_step(m, args.scale, args.world, log) for m in METHODS if m in wanted}
    print(
        f"One training step, GPT-2 small's tensors x{args.scale} (DDP buckets of {sm.BUCKET_MB * args.scale**2:.3g} "
        f"MB), N = {args.world} (fake group), torch {torch.__version__}; CUDA path on CPU tensors, Triton interpreted\n"
    )
    print("| method | baseline | DDP buckets | Triton | torch | collectives | total | vs baseline |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for m, r in rows.items():
        base = rows[METHODS[m][0] or m]
        buckets = "—" if r["buckets"] is None else _num(r["buckets"])
        print(
            f"| {m} | {base['method']} | {buckets} | {_num(r['triton'])} | {_num(r['torch'])} "
            f"| {_num(r['collectives'])} | {_num(r['total'])} | {r['total'] / base['total']:.3f}x |"
        )
    if args.by_caller:
        for m, r in rows.items():
            base = rows[METHODS[m][0] or m]["by_caller"]
            print(f"\n{m}: launches by caller (against {METHODS[m][0] or 'itself'})")
            for who in sorted(set(r["by_caller"]) | set(base), key=lambda k: -r["by_caller"].get(k, 0)):
                mine, theirs = r["by_caller"].get(who, 0), base.get(who, 0)
                print(f"  {_num(mine):>8} ({mine - theirs:+,.1f})  {who}")
    if args.json:
        Path(args.json).write_text(json.dumps(list(rows.values()), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
