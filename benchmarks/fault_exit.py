"""How long the surviving rank takes to stop when its peer dies or stalls, per strategy (2 CPU ranks, gloo).

    python benchmarks/fault_exit.py --repeats 3

Each run starts two processes the way Lightning sees externally launched ones (``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR/PORT``) with a small MLP. In the third training step rank 1 either SIGKILLs itself ("killed"),
or sleeps ("stalled") while the strategy's ``timeout`` is 10 s; just before, it writes the time. The figure
is rank 0's exit time minus that instant (wall clock of one machine), and rank 0's exit status. With the
strategies' default 30-minute timeout a killed peer is still detected at once (the TCP connection
closes); a stalled one only by the timeout, hence the 10 s.

Writes ``benchmarks/results/fault_exit.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests._helpers._launch
from tests._helpers._launch import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
GUARD_S = 120

SCRIPT = textwrap.dedent(
    """
    import datetime, os, signal, sys, time, warnings
    warnings.filterwarnings("ignore")
    import torch, lightning.pytorch as pl
    from torch import nn
    from lightning.pytorch.strategies import DDPStrategy
    from lightning_qcomm import (ActivationQuantization, LocalSGDStrategy, OneBitAdamCallback, QSDPStrategy,
                                 QuantDDPStrategy)
    torch.set_num_threads(1)
    rank, mode, stamp = int(os.environ["LOCAL_RANK"]), os.environ["FAULT_MODE"], os.environ["FAULT_STAMP"]
    T = datetime.timedelta(seconds=10) if mode == "stalled" else datetime.timedelta(minutes=30)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8))
        def training_step(self, batch, i):
            if rank == 1 and self.global_step == 2:
                with open(stamp, "w") as f:
                    f.write(repr(time.time()))
                if mode == "killed":
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(3600)
            x, y = batch
            return nn.functional.cross_entropy(self.body(x), y)
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        def train_dataloader(self):
            x = torch.randn(1024, 64)
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, :8].argmax(1)), batch_size=32)

    strategy, callbacks = {setup}
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, callbacks=callbacks, max_steps=50,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Net())
    """
)

SETUPS = {
    "ddp (Lightning)": "(DDPStrategy(timeout=T), [])",
    "QuantDDP uniform-8": "(QuantDDPStrategy(codec='uniform', bits=8, timeout=T), [])",
    "QSDP W8G8": "(QSDPStrategy(bits=8, min_quant_numel=0, timeout=T), [])",
    "Local SGD QSR": "(LocalSGDStrategy(sync='qsr', h_base=2, timeout=T), [])",
    "DDP + OneBitAdam (compressed)": "(DDPStrategy(timeout=T), [OneBitAdamCallback(freeze_step=1)])",
    "DDP + ActivationQuantization": "(DDPStrategy(timeout=T), [ActivationQuantization(bits=4)])",
}


def run_once(setup: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "run.py"
        script.write_text(SCRIPT.replace("{setup}", setup))
        stamp = Path(d) / "stamp"
        port = free_port()
        procs = []
        for rank in (0, 1):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
            env.update(LOCAL_RANK=str(rank), OMP_NUM_THREADS="1", FAULT_MODE=mode, FAULT_STAMP=str(stamp))
            # This checkout, installed or not (the script runs from a temporary folder).
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
                )
            )
        try:
            procs[0].wait(timeout=GUARD_S)
            exited = time.time()
            status = procs[0].returncode
        except subprocess.TimeoutExpired:
            exited, status = None, None
        finally:
            for p in procs:
                p.kill()
                p.wait()
        fault = float(stamp.read_text()) if stamp.exists() else None
    seconds = None if exited is None or fault is None else exited - fault
    return {"seconds": seconds, "status": status}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for name, setup in SETUPS.items():
        for mode in ("killed", "stalled"):
            runs = [run_once(setup, mode) for _ in range(args.repeats)]
            secs = [r["seconds"] for r in runs if r["seconds"] is not None]
            rows.append(
                {
                    "strategy": name,
                    "fault": mode,
                    "runs": runs,
                    "median_s": statistics.median(secs) if secs else None,
                    "max_s": max(secs) if secs else None,
                    "all_exited_nonzero": all(r["status"] not in (None, 0) for r in runs),
                }
            )
            print(rows[-1]["strategy"], mode, rows[-1]["median_s"], rows[-1]["max_s"], rows[-1]["all_exited_nonzero"])
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "fault_exit.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "# Seconds until the surviving rank stops",
        "",
        f"`python benchmarks/fault_exit.py --repeats {args.repeats}` (2 CPU ranks, gloo; rank 1 SIGKILLed, or stalled with",
        "the strategy's timeout at 10 s, in its third step; time from that instant to rank 0's exit).",
        "",
        "| strategy | peer | median s | max s | rank 0 exited with an error every time |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        fmt = lambda v: "—" if v is None else f"{v:.1f}"
        lines.append(
            f"| {r['strategy']} | {r['fault']} | {fmt(r['median_s'])} | {fmt(r['max_s'])} | "
            f"{'yes' if r['all_exited_nonzero'] else 'no'} |"
        )
    (RESULTS / "fault_exit.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
