"""netbench: every compression method side by side on a real, rate-limited network (issue 8, DESIGN §4).

Owns the benchmark harness: the two-node job on a shaped link, the variants, the measurement
(step time, interface bytes, ledger bytes, loss) and the report (markdown, JSON, PNG).

Network. As root: two network namespaces joined by a veth pair (10.88.0.1/24 in ns 0, 10.88.0.2/24
in ns 1), each end's egress shaped with ``tc qdisc ... tbf rate R``, so each direction carries at
most R. Everything is torn down on exit, on error and on Ctrl-C/SIGTERM. Not root (or
``--loopback``): both ranks on 127.0.0.1, unshaped, and the interface counters are machine-wide
(other processes' loopback traffic is counted too) - the run says so.

Job. One rank per namespace, started as a two-node Lightning job (``num_nodes=2, devices=1``,
``LightningEnvironment`` from MASTER_ADDR / MASTER_PORT / NODE_RANK / LOCAL_RANK / WORLD_SIZE).
Each rank is a long-lived worker that runs the whole interleaved schedule (variant x repeat), one
fresh ``Trainer`` per entry, so interpreter start-up and rendezvous stay out of every timing. The
worker creates the gloo process group once (Lightning then reuses it). If a worker fails or stalls,
both are killed and a fresh pair resumes the schedule after the failed entry.

Measurement, per entry and rank: timestamps at every ``on_train_batch_end``; the window is the steps
after ``--warmup``; step time = median (and mean) of the window's step durations; wire bytes = this
namespace's veth ``tx_bytes`` (``/proc/net/dev`` read inside the namespace) over the window; ledger
bytes = lightning_qcomm's ``CommLedger`` wire estimate over the window (for torch's own DDP hooks
and FSDP2, whose collectives our ledger never sees, a counter wrapped around the
``torch.distributed`` calls records into a ledger instead; the source is reported); loss = mean
training loss of the last 5 steps (over ranks) and the validation loss after the last step.

Compute floor ("floor"): the same DDP job with the gradient all-reduce replaced by a no-op comm
hook - same launcher, same process layout, same DDP bucket copies and optimizer, no traffic. Ranks
run with OMP_NUM_THREADS=1 and torch threads 1, each pinned to its own core (taskset) when the
machine has >= 2, with ``torch.set_flush_denormal(True)``. The report checks that the floor is not
slower than any communicating variant.

Efficiency = (floor + max over ranks of wire bytes per step / link rate) / measured mean step time.

Usage (root for namespaces; ~12 min for the default set at 100 and 1000 Mbit/s, 30 steps, 2 repeats):

    python benchmarks/netbench.py --rates 100,1000 --steps 30 --repeats 2 --out benchmarks/results
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import inspect
import json
import math
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# --------------------------------------------------------------------------------------------------
# Variants
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One row of the benchmark. ``family``: "floor", "torch" (torch/Lightning built-ins) or "lq"."""

    name: str
    family: str
    label: str
    needs: tuple[str, ...] = ()  # "module:Attr" candidates; one must import for the variant to run (lq variants)


QSDP = ("lightning_qcomm.strategies:QSDPStrategy", "lightning_qcomm.strategies.qsdp:QSDPStrategy")
QDDP = ("lightning_qcomm.strategies:QuantDDPStrategy", "lightning_qcomm.strategies.quant_ddp:QuantDDPStrategy")
LSGD = ("lightning_qcomm.strategies:LocalSGDStrategy", "lightning_qcomm.strategies.local_sgd:LocalSGDStrategy")
ONEBIT = ("lightning_qcomm.callbacks:OneBitAdamCallback", "lightning_qcomm.callbacks.onebit_adam:OneBitAdamCallback")

VARIANTS: tuple[Variant, ...] = (
    Variant("floor", "floor", "compute floor: DDP with a no-op comm hook (no traffic)"),
    Variant("ddp_fp32", "torch", "DDP fp32 all-reduce (torch allreduce_hook)"),
    Variant("ddp_fp16", "torch", "DDP + torch fp16_compress_hook"),
    Variant("powersgd_r4", "torch", "DDP + torch PowerSGD rank 4, error feedback, start iter 2"),
    Variant("fsdp2", "torch", "FSDP2 fp32 (ModelParallelStrategy, fully_shard per block + root)"),
    Variant("fsdp2_bf16", "torch", "FSDP2 with MixedPrecisionPolicy bf16 params+reduce"),
    Variant("post_local_sgd", "torch", "torch post-local SGD, period 4 (PeriodicModelAverager)"),
    Variant("qsdp_w8g8", "lq", "QSDPStrategy weight_bits=8 grad_bits=8", QSDP),
    Variant("qsdp_w4g4", "lq", "QSDPStrategy weight_bits=4 grad_bits=4", QSDP),
    Variant("qddp_uniform8", "lq", "QuantDDPStrategy uniform 8 bit", QDDP),
    Variant("qddp_fp8_e4m3", "lq", "QuantDDPStrategy fp8_e4m3", QDDP),
    Variant("qddp_nuqsgd4", "lq", "QuantDDPStrategy nuqsgd 4 bit", QDDP),
    Variant("qddp_qsgd4", "lq", "QuantDDPStrategy qsgd 4 bit", QDDP),
    Variant("localsgd_qsr", "lq", "LocalSGDStrategy sync=qsr h_base=4", LSGD),
    Variant("localsgd_h4", "lq", "LocalSGDStrategy sync=constant H=4", LSGD),
    Variant("onebit_adam", "lq", "DDP + OneBitAdamCallback", ONEBIT),
)
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}
BASELINE = "ddp_fp32"


def load_symbol(candidates: tuple[str, ...]) -> Any:
    """The first of ``"module:Attr"`` candidates that imports; ImportError naming all of them otherwise."""
    errors = []
    for cand in candidates:
        mod, _, attr = cand.partition(":")
        try:
            return getattr(__import__(mod, fromlist=[attr]), attr)
        except Exception as e:  # noqa: BLE001 - any import failure means "not landed (yet)"
            errors.append(f"{cand}: {type(e).__name__}: {e}")
    raise ImportError("; ".join(errors))


def variant_available(v: Variant) -> tuple[bool, str]:
    """Whether ``v.needs`` imports (lq variants land one by one); the reason when not."""
    if not v.needs:
        return True, ""
    try:
        load_symbol(v.needs)
    except ImportError as e:
        return False, f"not importable ({e})"
    return True, ""


# --------------------------------------------------------------------------------------------------
# Network: namespaces + veth + tbf, or loopback
# --------------------------------------------------------------------------------------------------


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def iface_bytes(iface: str) -> tuple[int, int]:
    """(tx_bytes, rx_bytes) of ``iface`` in the calling process's network namespace (/proc/net/dev)."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                fields = rest.split()
                return int(fields[8]), int(fields[0])
    raise ValueError(f"interface {iface!r} not found in /proc/net/dev")


class LoopbackNet:
    """Both ranks on 127.0.0.1; no shaping; ``lo`` counters include every process on the machine."""

    mode = "loopback"
    shaped = False

    def __init__(self) -> None:
        self.master_addr = "127.0.0.1"

    def iface(self, rank: int) -> str:
        return "lo"

    def prefix(self, rank: int) -> list[str]:
        return []

    def shape(self, rate_mbit: float | None) -> None:
        pass

    def link_check(self, rate_mbit: float | None) -> dict:
        return {}

    def __enter__(self) -> LoopbackNet:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


class NamespaceNet:
    """Two namespaces joined by a veth pair, each end's egress shaped by tbf (see module doc).

    Names carry this process's pid so concurrent runs (and other tools' namespaces) never collide.
    Only the addresses below are used, and only inside the two namespaces created here.
    """

    mode = "netns"
    shaped = True
    ADDRS = ("10.88.0.1", "10.88.0.2")

    def __init__(self, tag: str | None = None) -> None:
        tag = tag or str(os.getpid())
        self.ns = (f"lqnb{tag}a", f"lqnb{tag}b")
        self.veth = (f"lqv{tag}a"[-15:], f"lqv{tag}b"[-15:])
        self.master_addr = self.ADDRS[0]
        self._up = False

    def iface(self, rank: int) -> str:
        return self.veth[rank]

    def prefix(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.ns[rank]]

    def __enter__(self) -> NamespaceNet:
        try:
            for ns in self.ns:
                _sh("ip", "netns", "add", ns)
            self._up = True
            _sh("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            for i in (0, 1):
                _sh("ip", "link", "set", self.veth[i], "netns", self.ns[i])
                _sh("ip", "-n", self.ns[i], "addr", "add", f"{self.ADDRS[i]}/24", "dev", self.veth[i])
                _sh("ip", "-n", self.ns[i], "link", "set", self.veth[i], "up")
                _sh("ip", "-n", self.ns[i], "link", "set", "lo", "up")
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Delete both namespaces (which destroys the veth pair). Idempotent."""
        for ns in self.ns:
            _sh("ip", "netns", "del", ns, check=False)
        # a veth end left in the root namespace (failure between 'link add' and 'set netns')
        _sh("ip", "link", "del", self.veth[0], check=False)
        self._up = False

    def shape(self, rate_mbit: float | None) -> None:
        """tbf on both veth ends: each direction limited to ``rate_mbit`` Mbit/s (None: remove)."""
        for i in (0, 1):
            _sh("ip", "netns", "exec", self.ns[i], "tc", "qdisc", "del", "dev", self.veth[i], "root", check=False)
            if rate_mbit is None:
                continue
            # burst: >= 4 ms of traffic and >= 10 full frames, so the bucket never throttles below R.
            burst = max(16_000, int(rate_mbit * 1e6 / 8 * 0.004))
            _sh(
                "ip", "netns", "exec", self.ns[i], "tc", "qdisc", "add", "dev", self.veth[i], "root",
                "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "100ms",
            )  # fmt: skip

    def link_check(self, rate_mbit: float | None, seconds: float = 0.5) -> dict:
        """Send ~``seconds`` worth of bytes ns0 -> ns1 over TCP and measure the goodput."""
        nbytes = int(max(1e6, (rate_mbit or 1000) * 1e6 / 8 * seconds))
        port = 29400
        server = (
            "import socket,time,sys\n"
            f"s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);s.bind(('{self.ADDRS[1]}',{port}))\n"
            "s.listen(1);print('ready',flush=True);c,_=s.accept();n=0;t0=None\n"
            "while True:\n d=c.recv(1<<20)\n if t0 is None:t0=time.perf_counter()\n if not d:break\n n+=len(d)\n"
            "print(n,time.perf_counter()-t0,flush=True)\n"
        )
        srv = subprocess.Popen(
            [*self.prefix(1), sys.executable, "-c", server], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            srv.stdout.readline()
            client = (
                f"import socket;s=socket.create_connection(('{self.ADDRS[1]}',{port}));"
                f"b=bytes(1<<20);n={nbytes}\nwhile n>0:\n s.sendall(b[:min(n,1<<20)]);n-=1<<20\ns.close()"
            )
            _sh(*self.prefix(0), sys.executable, "-c", client)
            out, _ = srv.communicate(timeout=60)
            n, dt = out.split()
            mbit = int(n) * 8 / float(dt) / 1e6
            return {"bytes": int(n), "seconds": float(dt), "goodput_mbit": round(mbit, 1)}
        finally:
            if srv.poll() is None:
                srv.kill()


def make_net(args: argparse.Namespace):
    """NamespaceNet when root and the tools exist; LoopbackNet otherwise (with the reason printed)."""
    if args.loopback:
        print("[netbench] --loopback: both ranks on 127.0.0.1, unshaped, wire counters machine-wide.", flush=True)
        return LoopbackNet()
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        why = "not root" if os.geteuid() != 0 else f"missing tools {missing}"
        print(
            f"[netbench] WARNING: {why}: cannot create network namespaces; falling back to plain loopback "
            "(127.0.0.1, NO rate limit, counters include other processes' loopback traffic). "
            "Step times are not link-limited and efficiencies are not computed.",
            flush=True,
        )
        return LoopbackNet()
    return NamespaceNet()


# --------------------------------------------------------------------------------------------------
# Worker side (runs inside a namespace; imports torch/lightning lazily)
# --------------------------------------------------------------------------------------------------


class TorchCollectiveCounter:
    """Records every ``torch.distributed`` collective issued while active into a ``CommLedger``.

    Wraps the module-level functions of ``torch.distributed`` and ``distributed_c10d`` (hooks, FSDP2
    and the model averager call them through the module). Only the outermost call of nested wrappers
    is recorded. Wire estimates use the ledger's per-op factors.
    """

    OPS = {
        "all_reduce": ("all_reduce", "tensor"),
        "all_gather_into_tensor": ("all_gather", "output_tensor"),
        "all_gather_single": ("all_gather", "output_tensor"),
        "reduce_scatter_tensor": ("reduce_scatter", "input"),
        "reduce_scatter_single": ("reduce_scatter", "input"),
        "all_to_all_single": ("all_to_all", "input"),
        "broadcast": ("broadcast", "tensor"),
    }

    def __init__(self, ledger: Any, tag: str = "torch") -> None:
        self.ledger = ledger
        self.tag = tag
        self._saved: list[tuple[Any, str, Any]] = []
        self._local = threading.local()

    def _wrap(self, name: str, fn: Any) -> Any:
        import torch.distributed as dist

        op, arg = self.OPS[name]
        sig = inspect.signature(fn)
        counter = self

        def wrapped(*a: Any, **k: Any) -> Any:
            depth = getattr(counter._local, "depth", 0)
            if depth == 0:
                try:
                    bound = sig.bind_partial(*a, **k).arguments
                    t = bound[arg]
                    n = dist.get_world_size(bound.get("group"))
                    nbytes = t.numel() * t.element_size()
                    counter.ledger.record(op, nbytes, nbytes, n, tag=counter.tag)
                except Exception:  # noqa: BLE001 - accounting must never break the collective
                    pass
            counter._local.depth = depth + 1
            try:
                return fn(*a, **k)
            finally:
                counter._local.depth = depth

        wrapped.__wrapped__ = fn
        return wrapped

    def __enter__(self) -> TorchCollectiveCounter:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for mod in (dist, c10d):
            for name in self.OPS:
                fn = getattr(mod, name, None)
                if fn is not None:
                    self._saved.append((mod, name, fn))
                    setattr(mod, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc: Any) -> None:
        for mod, name, fn in reversed(self._saved):
            setattr(mod, name, fn)
        self._saved.clear()


def _ledger_wire(ledger: Any) -> tuple[float, int]:
    tot = ledger.summarize(ledger.cumulative, by="all").get("all")
    return (tot.wire_bytes, tot.calls) if tot is not None else (0.0, 0)


def _make_step_timer(warmup: int, iface: str, ledgers: dict[str, Any]):
    import lightning.pytorch as pl

    class StepTimer(pl.Callback):
        """Timestamps every step end; snapshots interface and ledger counters at the window edges."""

        def __init__(self) -> None:
            self.stamps: list[float] = []
            self.snaps: list[dict] = []

        def snapshot(self) -> dict:
            tx, rx = iface_bytes(iface)
            snap = {"t": time.perf_counter(), "tx": tx, "rx": rx}
            for key, led in ledgers.items():
                snap[key], snap[key + "_calls"] = _ledger_wire(led)
            return snap

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.stamps.append(time.perf_counter())
            if len(self.stamps) == warmup:
                self.snaps = [self.snapshot()]

        def on_train_end(self, trainer, pl_module) -> None:
            pass

        def close_window(self) -> None:
            # called from on_train_batch_end of the last step via the stamps: the end snapshot is
            # taken right after the last step, before validation traffic
            self.snaps.append(self.snapshot())

    return StepTimer


def _build_strategy(name: str, spec: dict):
    """(strategy, module class, extra module kwargs, callbacks) for variant ``name``."""
    from datetime import timedelta

    from bench_model import BenchLM, BenchLMFSDP2
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from torch.distributed.algorithms.ddp_comm_hooks import debugging_hooks, default_hooks, powerSGD_hook
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook as pls

    timeout = timedelta(seconds=spec["collective_timeout"])

    class CPUHookDDPStrategy(DDPStrategy):
        """DDPStrategy that registers its comm hook on CPU too (Lightning registers only on CUDA)."""

        def _register_ddp_hooks(self) -> None:
            from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook

            if self._ddp_comm_hook is not None:
                _register_ddp_comm_hook(
                    model=self.model,
                    ddp_comm_state=self._ddp_comm_state,
                    ddp_comm_hook=self._ddp_comm_hook,
                    ddp_comm_wrapper=self._ddp_comm_wrapper,
                )

    ddp = lambda **kw: CPUHookDDPStrategy(process_group_backend="gloo", timeout=timeout, **kw)
    warmup = spec["warmup"]
    if name == "floor":
        return ddp(ddp_comm_hook=debugging_hooks.noop_hook), BenchLM, {}, []
    if name == "ddp_fp32":
        return ddp(ddp_comm_hook=default_hooks.allreduce_hook), BenchLM, {}, []
    if name == "ddp_fp16":
        return ddp(ddp_comm_hook=default_hooks.fp16_compress_hook), BenchLM, {}, []
    if name == "powersgd_r4":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2, use_error_feedback=True
        )
        return ddp(ddp_comm_state=state, ddp_comm_hook=powerSGD_hook.powerSGD_hook), BenchLM, {}, []
    if name == "post_local_sgd":
        state = pls.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=warmup, post_local_gradient_allreduce=False
        )
        return (
            ddp(ddp_comm_state=state, ddp_comm_hook=pls.post_localSGD_hook, model_averaging_period=4),
            BenchLM,
            {},
            [],
        )
    if name in ("fsdp2", "fsdp2_bf16"):
        strat = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1, timeout=timeout)
        return strat, BenchLMFSDP2, {"mp_dtype": "bfloat16" if name == "fsdp2_bf16" else None}, []
    if name.startswith("qsdp_"):
        QSDPStrategy = load_symbol(QSDP)

        bits = 8 if name == "qsdp_w8g8" else 4
        return QSDPStrategy(weight_bits=bits, grad_bits=bits, timeout=timeout), BenchLM, {}, []
    if name.startswith("qddp_"):
        QuantDDPStrategy = load_symbol(QDDP)

        codec, bits = {
            "qddp_uniform8": ("uniform", 8),
            "qddp_fp8_e4m3": ("fp8_e4m3", 8),
            "qddp_nuqsgd4": ("nuqsgd", 4),
            "qddp_qsgd4": ("qsgd", 4),
        }[name]
        return QuantDDPStrategy(codec=codec, bits=bits, process_group_backend="gloo", timeout=timeout), BenchLM, {}, []
    if name.startswith("localsgd_"):
        LocalSGDStrategy = load_symbol(LSGD)

        if name == "localsgd_qsr":
            # alpha = 2 * peak lr: H = h_base while lr >= lr_peak / 2, then (alpha / lr)^2 as lr decays
            strat = LocalSGDStrategy(sync="qsr", h_base=4, alpha=2.0 * spec["lr"], timeout=timeout)
        else:
            strat = LocalSGDStrategy(sync="constant", h_base=4, period=4, timeout=timeout)
        return strat, BenchLM, {}, []
    if name == "onebit_adam":
        OneBitAdamCallback = load_symbol(ONEBIT)

        return ddp(), BenchLM, {}, [OneBitAdamCallback(freeze_step=warmup)]
    raise ValueError(f"unknown variant {name!r}; known: {sorted(VARIANT_BY_NAME)}")


def _run_entry(entry: dict, spec: dict, rank: int) -> dict:
    import lightning.pytorch as pl
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_qcomm.comm import CommLedger, set_ledger

    name = entry["variant"]
    steps, warmup = spec["steps"], spec["warmup"]
    pl.seed_everything(spec["seed"], verbose=False)
    strategy, module_cls, module_kw, callbacks = _build_strategy(name, spec)
    module = module_cls(
        preset=spec["preset"],
        lr=spec["lr"],
        total_steps=steps,
        warmup_steps=max(1, min(3, steps // 5)),
        batch_size=spec["batch_size"],
        seed=spec["seed"],
        **module_kw,
    )
    lq_ledger, dist_ledger = CommLedger(), CommLedger()
    set_ledger(lq_ledger)
    timer = _make_step_timer(warmup, spec["ifaces"][rank], {"lq": lq_ledger, "dist": dist_ledger})()

    class CloseWindow(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if len(timer.stamps) == steps:
                timer.close_window()

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        num_nodes=2,
        strategy=strategy,
        plugins=[LightningEnvironment()],
        max_steps=steps,
        val_check_interval=steps,
        limit_val_batches=spec["val_batches"],
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[*callbacks, timer, CloseWindow()],
    )
    t0 = time.perf_counter()
    with TorchCollectiveCounter(dist_ledger):
        trainer.fit(module)
    fit_s = time.perf_counter() - t0
    set_ledger(None)
    if len(timer.snaps) != 2:
        raise RuntimeError(f"{name}: ran {len(timer.stamps)} steps, expected {steps} (window not closed)")
    a, b = timer.snaps
    n = steps - warmup
    durations = [t1 - t0_ for t0_, t1 in zip(timer.stamps[warmup - 1 : -1], timer.stamps[warmup:])]
    val = trainer.callback_metrics.get("val_loss")
    ledger_key = "lq" if (b["lq_calls"] - a["lq_calls"]) > 0 else "dist"
    return {
        "variant": name,
        "repeat": entry["repeat"],
        "rank": rank,
        "ok": True,
        "steps_measured": n,
        "step_median_s": statistics.median(durations),
        "step_mean_s": (b["t"] - a["t"]) / n,
        "step_times_s": durations,
        "tx_per_step": (b["tx"] - a["tx"]) / n / spec["wire_divisor"],
        "rx_per_step": (b["rx"] - a["rx"]) / n / spec["wire_divisor"],
        "ledger_per_step": (b[ledger_key] - a[ledger_key]) / n,
        "ledger_source": {"lq": "lightning_qcomm CommLedger", "dist": "torch.distributed call counter"}[ledger_key],
        "lq_ledger_per_step": (b["lq"] - a["lq"]) / n,
        "dist_per_step": (b["dist"] - a["dist"]) / n,
        "train_loss_last5": statistics.fmean(module.train_losses[-5:]),
        "val_loss": float(val) if val is not None else None,
        "fit_s": fit_s,
        "params": module.describe()["params"],
    }


def worker_main(args: argparse.Namespace) -> int:
    """Run this rank's share of the schedule in ``args.spec``; one JSON line per event to ``args.results``."""
    spec = json.loads(Path(args.spec).read_text())
    rank = args.rank
    sys.path[:0] = [str(HERE), str(REPO)]
    import torch
    import torch.distributed as dist

    torch.set_num_threads(spec["threads"])
    if spec["flush_denormal"]:
        torch.set_flush_denormal(True)
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)

    from datetime import timedelta

    dist.init_process_group(
        "gloo", init_method="env://", rank=rank, world_size=2, timeout=timedelta(seconds=spec["collective_timeout"])
    )
    out = open(args.results, "a", buffering=1)
    for entry in spec["schedule"]:
        out.write(json.dumps({"event": "start", "id": entry["id"], "variant": entry["variant"], "rank": rank}) + "\n")
        dist.barrier()
        try:
            res = _run_entry(entry, spec, rank)
        except BaseException as e:  # noqa: BLE001 - reported, then the orchestrator restarts the pair
            import traceback

            out.write(
                json.dumps(
                    {
                        "event": "error",
                        "id": entry["id"],
                        "variant": entry["variant"],
                        "rank": rank,
                        "error": f"{type(e).__name__}: {e}",
                        "traceback": traceback.format_exc()[-4000:],
                    }
                )
                + "\n"
            )
            out.close()
            return 3
        res.update(event="done", id=entry["id"], rate_mbit=spec["rate_mbit"])
        out.write(json.dumps(res) + "\n")
    dist.barrier()
    out.close()
    dist.destroy_process_group()
    return 0


# --------------------------------------------------------------------------------------------------
# Orchestrator
# --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            rows.append(json.loads(line))
    return rows


def make_schedule(names: list[str], repeats: int) -> list[dict]:
    """Interleaved: every repeat runs every variant; odd repeats run in reverse order (drift cancels)."""
    sched = []
    for r in range(repeats):
        order = names if r % 2 == 0 else names[::-1]
        sched += [{"id": len(sched) + i, "variant": v, "repeat": r} for i, v in enumerate(order)]
    return sched


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.time() + 5
    for p in procs:
        while p.poll() is None and time.time() < deadline:
            time.sleep(0.1)
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run_schedule(
    net, rate_mbit: float | None, schedule: list[dict], args: argparse.Namespace, workdir: Path
) -> list[dict]:
    """Run ``schedule`` on a worker pair, restarting a fresh pair after a failed entry."""
    results: list[dict] = []
    remaining = list(schedule)
    attempt = 0
    ncpu = os.cpu_count() or 1
    while remaining:
        attempt += 1
        tag = f"r{rate_mbit}_a{attempt}"
        spec = {
            "schedule": remaining,
            "rate_mbit": rate_mbit,
            "steps": args.steps,
            "warmup": args.warmup,
            "preset": args.model,
            "batch_size": args.batch_size,
            "lr": args.lr,
            "seed": args.seed,
            "val_batches": 2,
            "threads": args.threads,
            "flush_denormal": not args.no_flush_denormal,
            "collective_timeout": args.collective_timeout,
            "ifaces": [net.iface(0), net.iface(1)],
            # on lo every packet of both ranks is counted once: a rank's share is half
            "wire_divisor": 2 if net.mode == "loopback" else 1,
        }
        spec_path = workdir / f"spec_{tag}.json"
        spec_path.write_text(json.dumps(spec))
        port = _free_port() if net.mode == "loopback" else 29500 + attempt
        procs, res_paths, logs = [], [], []
        for rank in (0, 1):
            env = dict(os.environ)
            env.update(
                OMP_NUM_THREADS=str(args.threads),
                MKL_NUM_THREADS=str(args.threads),
                MASTER_ADDR=net.master_addr,
                MASTER_PORT=str(port),
                NODE_RANK=str(rank),
                LOCAL_RANK="0",
                WORLD_SIZE="2",
                GLOO_SOCKET_IFNAME=net.iface(rank),
                PYTHONPATH=os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")]),
                PYTHONUNBUFFERED="1",
            )
            for k in (
                "RANK",
                "GROUP_RANK",
                "LOCAL_WORLD_SIZE",
                "TORCHELASTIC_RUN_ID",
                "SLURM_NTASKS",
                "SLURM_JOB_NAME",
            ):
                env.pop(k, None)
            pin = ["taskset", "-c", str(rank % ncpu)] if (args.pin and ncpu >= 2 and shutil.which("taskset")) else []
            res_path = workdir / f"results_{tag}_rank{rank}.jsonl"
            log_path = workdir / f"log_{tag}_rank{rank}.txt"
            cmd = [*net.prefix(rank), *pin, sys.executable, str(Path(__file__).resolve()), "--worker"]
            cmd += ["--spec", str(spec_path), "--rank", str(rank), "--results", str(res_path)]
            logf = open(log_path, "w")
            procs.append(subprocess.Popen(cmd, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True))
            res_paths.append(res_path)
            logs.append((logf, log_path))
        last_progress, seen = time.time(), 0
        failed_reason = None
        try:
            while True:
                time.sleep(0.5)
                rows = [_read_jsonl(p) for p in res_paths]
                n = sum(len(r) for r in rows)
                if n != seen:
                    seen, last_progress = n, time.time()
                    for r in rows[0][-1:]:
                        if r.get("event") == "done":
                            print(
                                f"[netbench] rate={rate_mbit} {r['variant']:<16} rep {r['repeat']} "
                                f"step {r['step_median_s'] * 1e3:8.1f} ms  tx {r['tx_per_step'] / 1e6:7.3f} MB",
                                flush=True,
                            )
                codes = [p.poll() for p in procs]
                if all(c == 0 for c in codes):
                    break
                if any(c not in (None, 0) for c in codes):
                    time.sleep(3)  # let the peer write its error line
                    failed_reason = f"worker exit codes {[p.poll() for p in procs]}"
                    break
                if time.time() - last_progress > args.variant_timeout:
                    failed_reason = f"no progress for {args.variant_timeout}s"
                    break
        finally:
            _kill(procs)
            for f, _ in logs:
                f.close()
        rows = [_read_jsonl(p) for p in res_paths]
        done = {
            r["id"]: r for rr in rows for r in rr if r.get("event") == "done"
        }  # keyed by id: both ranks' rows are kept below
        done_ids = {
            i for i in done if all(any(r.get("id") == i and r.get("event") == "done" for r in rr) for rr in rows)
        }
        results += [r for rr in rows for r in rr if r.get("event") == "done" and r["id"] in done_ids]
        remaining = [e for e in remaining if e["id"] not in done_ids]
        if failed_reason and remaining:
            bad = remaining.pop(0)
            errs = [r for rr in rows for r in rr if r.get("event") == "error" and r["id"] == bad["id"]]
            msg = errs[0]["error"] if errs else failed_reason
            tail = (
                "".join(open(logs[0][1]).readlines()[-15:] + open(logs[1][1]).readlines()[-15:])
                if not errs
                else errs[0].get("traceback", "")
            )
            print(f"[netbench] rate={rate_mbit} {bad['variant']} rep {bad['repeat']} FAILED: {msg}", flush=True)
            if args.verbose:
                print(tail, flush=True)
            results.append(
                {"event": "error", "variant": bad["variant"], "repeat": bad["repeat"], "rate_mbit": rate_mbit,
                 "error": msg, "log_tail": tail[-2000:]}
            )  # fmt: skip
    return results


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def aggregate(results: list[dict], rates: list[float | None], names: list[str]) -> dict:
    """Per (rate, variant): medians over repeats of the slower rank's step time, bytes, losses, efficiency."""
    table: dict = {}
    for rate in rates:
        rows: dict[str, dict] = {}
        for name in names:
            rs = [r for r in results if r.get("event") == "done" and r["variant"] == name and r["rate_mbit"] == rate]
            errs = [r for r in results if r.get("event") == "error" and r["variant"] == name and r["rate_mbit"] == rate]
            if not rs:
                if errs:
                    rows[name] = {"error": errs[0]["error"]}
                continue
            reps = sorted({r["repeat"] for r in rs})
            per_rep = []
            for rep in reps:
                rr = [r for r in rs if r["repeat"] == rep]
                per_rep.append(
                    {
                        "step_median_s": max(r["step_median_s"] for r in rr),
                        "step_mean_s": max(r["step_mean_s"] for r in rr),
                        "tx_max": max(r["tx_per_step"] for r in rr),
                        "tx_mean": statistics.fmean(r["tx_per_step"] for r in rr),
                        "ledger_mean": statistics.fmean(r["ledger_per_step"] for r in rr),
                        "dist_mean": statistics.fmean(r["dist_per_step"] for r in rr),
                        "train_loss": statistics.fmean(r["train_loss_last5"] for r in rr),
                        "val_loss": statistics.fmean(r["val_loss"] for r in rr) if all(r["val_loss"] is not None for r in rr) else None,
                    }
                )  # fmt: skip
            agg = {k: _med([p[k] for p in per_rep if p[k] is not None]) for k in per_rep[0]}
            agg["repeats"] = len(per_rep)
            agg["step_mean_spread_s"] = [min(p["step_mean_s"] for p in per_rep), max(p["step_mean_s"] for p in per_rep)]
            agg["ledger_source"] = rs[0]["ledger_source"]
            agg["wire_over_ledger"] = agg["tx_mean"] / agg["ledger_mean"] if agg["ledger_mean"] > 0 else None
            if errs:
                agg["errors"] = len(errs)
            rows[name] = agg
        floor = rows.get("floor", {}).get("step_mean_s")
        base = rows.get(BASELINE, {})
        for row in rows.values():
            if "error" in row and "step_mean_s" not in row:
                continue
            if base.get("step_mean_s"):
                row["speedup_vs_fp32"] = base["step_mean_s"] / row["step_mean_s"]
                row["bytes_vs_fp32"] = row["tx_max"] / base["tx_max"] if base["tx_max"] > 0 else None
            if rate is not None and floor:
                row["ideal_s"] = floor + row["tx_max"] / (rate * 1e6 / 8)
                row["efficiency"] = row["ideal_s"] / row["step_mean_s"]
        comm = {n: r["step_mean_s"] for n, r in rows.items() if n != "floor" and "step_mean_s" in r}
        floor_ok = None
        if floor is not None and comm:
            floor_ok = floor <= min(comm.values())
        table[str(rate)] = {"rows": rows, "floor_s": floor, "floor_sound": floor_ok}
    return table


def _fmt(x: Any, spec: str = ".2f", scale: float = 1.0) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return format(x * scale, spec)


def render_markdown(table: dict, meta: dict, names: list[str]) -> str:
    lines = [f"# netbench: compression methods on a rate-limited link ({meta['date']})", ""]
    if meta.get("note"):
        lines += [f"**{meta['note']}**", ""]
    lines += [
        f"Command: `{meta['command']}`  ",
        f"Machine: {meta['machine']}  ",
        f"Network: {meta['network']}  ",
        f"Model: {meta['model']}; batch {meta['batch_size']} x {meta['seq_len']} tokens per rank, "
        f"{meta['steps']} steps ({meta['warmup']} warm-up steps excluded), {meta['repeats']} interleaved repeats, "
        f"threads/rank {meta['threads']}, pinned {meta['pinned']}, flush_denormal {meta['flush_denormal']}.  ",
        f"Duration: {meta['duration_s']:.0f} s.",
        "",
        "Columns: step = slower rank's mean step time over the measured window (median over repeats; "
        "[min-max] over repeats); median = median step duration; wire = veth tx bytes per step, max over ranks; "
        "ledger = ledger wire estimate per step (mean over ranks; source below), wire/ledger uses the "
        "mean-over-ranks wire; ideal = floor + wire / rate; eff = ideal / step; loss = training loss "
        "(mean of last 5 steps, mean over ranks), val = validation loss after the last step.",
        "",
    ]
    for rate, block in table.items():
        rows = block["rows"]
        title = f"{float(rate):g} Mbit/s per direction" if rate != "None" else "unshaped loopback"
        lines += [f"## {title}", ""]
        if block["floor_sound"] is False:
            lines += ["**WARNING: the compute floor is slower than a communicating variant; the floor is unsound "
                      "in this run (noise?) and efficiencies are unreliable.**", ""]  # fmt: skip
        elif block["floor_sound"]:
            lines += ["Floor check: the compute floor is faster than every communicating variant.", ""]
        lines += [
            "| variant | step ms [min-max] | median ms | speedup vs DDP fp32 | wire MB/step | bytes vs fp32 "
            "| ledger MB/step | wire/ledger | ideal ms | eff | loss | val |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name in names:
            r = rows.get(name)
            if r is None:
                continue
            if "step_mean_s" not in r:
                lines.append(f"| {name} | FAILED: {r['error'][:80]} |" + " |" * 10)
                continue
            lo, hi = r["step_mean_spread_s"]
            lines.append(
                f"| {name} | {_fmt(r['step_mean_s'], '.0f', 1e3)} [{_fmt(lo, '.0f', 1e3)}-{_fmt(hi, '.0f', 1e3)}] "
                f"| {_fmt(r['step_median_s'], '.0f', 1e3)} | {_fmt(r.get('speedup_vs_fp32'))}x "
                f"| {_fmt(r['tx_max'], '.3f', 1e-6)} | {_fmt(r.get('bytes_vs_fp32'), '.3f')} "
                f"| {_fmt(r['ledger_mean'], '.3f', 1e-6)} | {_fmt(r.get('wire_over_ledger'), '.3f')} "
                f"| {_fmt(r.get('ideal_s'), '.0f', 1e3)} | {_fmt(r.get('efficiency'))} "
                f"| {_fmt(r['train_loss'], '.3f')} | {_fmt(r['val_loss'], '.3f')} |"
            )
        lines.append("")
    lines += ["## Variants", ""]
    for name in names:
        v = VARIANT_BY_NAME[name]
        lines.append(f"- `{name}`: {v.label}")
    if meta["skipped"]:
        lines += ["", "Skipped (not landed / not importable):", ""]
        lines += [f"- `{n}`: {why}" for n, why in meta["skipped"].items()]
    lines += [
        "",
        "Ledger sources: lightning_qcomm variants report their own `CommLedger`; torch's hooks, FSDP2 and the "
        "post-local SGD averager are counted by wrapping the `torch.distributed` collectives in the worker. "
        "Wire bytes include TCP/IP/Ethernet headers and the ACKs for the peer's traffic (~3-7% at MTU 1500).",
    ]
    if meta.get("link_checks"):
        lines += ["", "Link check (TCP goodput ns0 -> ns1 after shaping): "
                  + "; ".join(f"{k} Mbit/s: {v.get('goodput_mbit')} Mbit/s" for k, v in meta["link_checks"].items())]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(table: dict, names: list[str], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[netbench] matplotlib not installed (pip install -e .[bench]); no plot.", flush=True)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    markers = "os^vD<>pP*hX"
    for ri, (rate, block) in enumerate(table.items()):
        for i, name in enumerate(names):
            r = block["rows"].get(name)
            if not r or "step_mean_s" not in r:
                continue
            x = max(r["tx_max"], 1e3) / 1e6
            lbl = f"{name} @ {rate}" if ri == 0 else None
            kw = {"marker": markers[i % len(markers)], "color": f"C{i % 10}", "alpha": 1.0 if ri == 0 else 0.55}
            axes[0].scatter(x, r["step_mean_s"] * 1e3, label=lbl, **kw)
            axes[1].scatter(x, r["train_loss"], **kw)
    axes[0].set(xscale="log", yscale="log", xlabel="wire MB per step per rank (veth tx)", ylabel="step time (ms)")
    axes[0].set_title("step time vs bytes (solid: first rate, faded: second)")
    axes[1].set(xscale="log", xlabel="wire MB per step per rank (veth tx)", ylabel="training loss (last 5 steps)")
    axes[1].set_title("loss vs bytes (same steps)")
    fig.legend(loc="lower center", ncol=6, fontsize=7)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine_line() -> str:
    cpu = platform.processor() or "?"
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        import lightning
        import torch

        vers = f"torch {torch.__version__}, lightning {lightning.__version__}"
    except ImportError:
        vers = ""
    return f"{os.cpu_count()} CPUs ({cpu}), Linux {platform.release()}, Python {platform.python_version()}, {vers}"


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rates", default="100,1000", help="link rates in Mbit/s, comma separated (default 100,1000)")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps per entry (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from timing (default 5)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats per rate (default 2)")
    p.add_argument("--variants", default="all", help=f"comma list or 'all' (known: {','.join(VARIANT_BY_NAME)})")
    p.add_argument("--model", default="bench", help="bench_model preset: bench (3.3M params), small, tiny")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step (default 4)")
    p.add_argument("--lr", type=float, default=2e-3, help="peak AdamW learning rate (default 2e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch/OMP threads per rank (default 1)")
    p.add_argument("--no-pin", dest="pin", action="store_false", help="do not pin rank i to core i with taskset")
    p.add_argument("--no-flush-denormal", action="store_true", help="keep denormals (to study their effect)")
    p.add_argument("--loopback", action="store_true", help="force the unshaped loopback fallback")
    p.add_argument("--out", default="benchmarks/results", help="output folder (netbench.md/.json/.png)")
    p.add_argument("--name", default="netbench", help="output file stem (default netbench)")
    p.add_argument("--note", default="", help="a line printed at the top of the report (e.g. PRELIMINARY ...)")
    p.add_argument("--variant-timeout", type=float, default=300.0, help="kill a pair making no progress (s)")
    p.add_argument("--collective-timeout", type=float, default=240.0, help="gloo timeout (s)")
    p.add_argument("--verbose", action="store_true")
    # worker mode (internal)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--results", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.steps < 2 or not (1 <= args.warmup < args.steps):
        p.error(f"need steps >= 2 and 1 <= warmup < steps, got steps={args.steps} warmup={args.warmup}")
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    return args


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args)
    sys.path[:0] = [str(HERE), str(REPO)]
    if args.variants == "all":
        wanted = [v.name for v in VARIANTS]
    else:
        wanted = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in VARIANT_BY_NAME]
        if unknown:
            raise SystemExit(f"--variants: unknown {unknown}; known: {sorted(VARIANT_BY_NAME)}")
    skipped, names = {}, []
    for n in wanted:
        ok, why = variant_available(VARIANT_BY_NAME[n])
        (names.append(n) if ok else skipped.__setitem__(n, why))
    if skipped:
        print(f"[netbench] skipped (not landed): {', '.join(skipped)}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    net = make_net(args)
    rates: list[float | None] = [float(r) for r in args.rates.split(",")] if net.shaped else [None]
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)
    t_start = time.time()
    results: list[dict] = []
    link_checks: dict = {}
    interrupted = False
    workdir = Path(tempfile.mkdtemp(prefix="netbench_"))
    try:
        with net:
            for rate in rates:
                net.shape(rate)
                if net.shaped:
                    link_checks[f"{rate:g}"] = net.link_check(rate)
                    print(f"[netbench] link check at {rate:g} Mbit/s: {link_checks[f'{rate:g}']}", flush=True)
                results += run_schedule(net, rate, make_schedule(names, args.repeats), args, workdir)
    except KeyboardInterrupt:
        interrupted = True
        print("[netbench] interrupted: namespaces torn down; writing partial results.", flush=True)
    finally:
        if not args.verbose:
            shutil.rmtree(workdir, ignore_errors=True)
    from bench_model import MODEL_PRESETS, GPTConfig  # noqa: F401 - light import (torch only)

    cfg = MODEL_PRESETS[args.model]
    params = next((r["params"] for r in results if r.get("params")), None)
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python " + " ".join([os.path.relpath(__file__) if Path(__file__).exists() else __file__, *(argv if argv is not None else sys.argv[1:])]),
        "note": args.note + (" (INTERRUPTED: partial)" if interrupted else ""),
        "machine": machine_line(),
        "network": (
            "two network namespaces + veth pair, tbf on each end (each direction shaped), MTU 1500"
            if net.shaped
            else "loopback fallback (unshaped; counters machine-wide)"
        ),
        "model": f"GPT preset '{args.model}' ({params or '?'} params, d={cfg.d_model}, layers={cfg.n_layer}, vocab={cfg.vocab_size})",
        "batch_size": args.batch_size,
        "seq_len": cfg.seq_len,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "threads": args.threads,
        "pinned": bool(args.pin and (os.cpu_count() or 1) >= 2),
        "flush_denormal": not args.no_flush_denormal,
        "duration_s": time.time() - t_start,
        "skipped": skipped,
        "link_checks": link_checks,
        "mode": net.mode,
    }  # fmt: skip
    table = aggregate(results, rates, names)
    md = render_markdown(table, meta, names)
    (out / f"{args.name}.md").write_text(md)
    (out / f"{args.name}.json").write_text(json.dumps({"meta": meta, "table": table, "raw": results}, indent=1))
    plotted = plot(table, names, out / f"{args.name}.png")
    print(md, flush=True)
    print(f"[netbench] wrote {out / (args.name + '.md')}, .json" + (", .png" if plotted else ""), flush=True)
    failed = [r for r in results if r.get("event") == "error"]
    return 1 if (interrupted or failed) else 0


if __name__ == "__main__":
    sys.exit(main())
