"""What ``benchmarks/fidelity.py`` trains: the methods, their baselines and goals, and the stdlib-bytes GPT.

* ``METHODS``: one ``Method`` per row of the fidelity table, each paired with the baseline it is judged
  against (QSDP vs FSDP2 fp32; QuantDDP codecs, Local SGD, OneBitAdam and ActivationQuantization vs DDP fp32
  + AdamW, which is also the fp32-activation run). Strategies and callbacks come from
  ``benchmarks.netbench.build.build_variant``, so a row here trains what the netbench row of the same
  name times; only ``actq_4bit`` (DDP fp32 + ``ActivationQuantization(bits=4)``) is built here.
* ``RunConfig`` and ``phase_steps``: the schedule every method shares (warm-up + cosine to 10%), plus the
  step counts that follow from it (OneBitAdam's freeze, post-local SGD's switch).
* ``StdlibLM`` / ``StdlibLMFSDP2``: ``bench_model.BenchLM`` (GPT, AdamW, warm-up + cosine) on the byte
  stream of the Python standard library (``lightning_qcomm.demo.stdlib_corpus``); the last 5% of the corpus
  is held out and a fixed, evenly spaced set of its windows is the validation set. Validation returns the
  exact mean next-byte cross-entropy over that whole set (sums all-reduced across ranks), recorded with the
  optimizer step in ``val_curve``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, Subset

from benchmarks.bench_model import BenchLM, BenchLMFSDP2


@dataclass(frozen=True)
class Method:
    """One row: ``baseline`` is the method it is compared with (None: it is a baseline); ``goal_pct`` the
    largest allowed relative gap of its final validation loss over the baseline's (None: no goal);
    ``multi_seed``: run with every seed of ``--seeds`` (else seed 0 only)."""

    name: str
    label: str
    baseline: str | None
    goal_pct: float | None
    multi_seed: bool
    in_default: bool = True


METHODS: tuple[Method, ...] = (
    Method("ddp_fp32", "DDP fp32 all-reduce + AdamW (torch allreduce_hook)", None, None, True),
    Method("fsdp2", "FSDP2 fp32 (ModelParallelStrategy; fully_shard per block, then the model)", None, None, True),
    Method("qsdp_w8g8", "QSDPStrategy(weight_bits=8, grad_bits=8)", "fsdp2", 1.0, True),
    Method("qsdp_w4g4", "QSDPStrategy(weight_bits=4, grad_bits=4)", "fsdp2", 2.0, False, in_default=False),
    Method("qddp_uniform8", "QuantDDPStrategy(codec='uniform', bits=8)", "ddp_fp32", 1.0, True),
    Method("qddp_fp8_e4m3", "QuantDDPStrategy(codec='fp8_e4m3', bits=8)", "ddp_fp32", 1.0, False),
    Method("qddp_nuqsgd4", "QuantDDPStrategy(codec='nuqsgd', bits=4)", "ddp_fp32", 2.0, True),
    Method("qddp_qsgd4", "QuantDDPStrategy(codec='qsgd', bits=4) (its default bucket: 128)", "ddp_fp32", 2.0, False),
    Method(
        "qddp_qsgd4_b512", "QuantDDPStrategy(codec='qsgd', bits=4, bucket_size=512) (the old default)", "ddp_fp32",
        2.0, True, in_default=False,
    ),
    Method(
        "localsgd_qsr", "LocalSGDStrategy(sync='qsr', h_base=4, alpha=2*peak lr, warmup_steps=lr warm-up)",
        "ddp_fp32", 0.0, True,
    ),
    Method("localsgd_h4", "LocalSGDStrategy(sync='constant', period=4)", "ddp_fp32", None, False),
    Method(
        "localsgd_qsr_avgstate", "LocalSGDStrategy(sync='qsr', ..., average_optimizer_state=True)", "ddp_fp32", 0.0,
        False, in_default=False,
    ),
    Method(
        "localsgd_qsr_overlap", "LocalSGDStrategy(sync='qsr', ..., overlap=True): the average overlapped with the next round",
        "ddp_fp32", 0.0, True, in_default=False,
    ),
    Method(
        "localsgd_h1", "LocalSGDStrategy(sync='constant', period=1): parameters averaged after every local AdamW step",
        "ddp_fp32", None, False, in_default=False,
    ),
    Method(
        "localsgd_h2", "LocalSGDStrategy(sync='constant', period=2): inline, the shortest period (QSR's h_base floor)",
        "ddp_fp32", None, False, in_default=False,
    ),
    Method(
        "localsgd_h8", "LocalSGDStrategy(sync='constant', period=8): inline, twice H=4's period (the overlap's drift)",
        "ddp_fp32", None, False, in_default=False,
    ),
    Method(
        "localsgd_h4_overlap", "LocalSGDStrategy(sync='constant', period=4, overlap=True)", "ddp_fp32", None, False,
        in_default=False,
    ),
    Method(
        "localsgd_h12", "LocalSGDStrategy(sync='constant', period=12): inline, the overlapped H=4's mean drift",
        "ddp_fp32", None, False, in_default=False,
    ),
    Method(
        "localsgd_h2_overlap", "LocalSGDStrategy(sync='constant', period=2, overlap=True)", "ddp_fp32", None, False,
        in_default=False,
    ),
    Method(
        "post_local_sgd", "torch post-local SGD: DDP until the switch step, then PeriodicModelAverager(4)",
        "ddp_fp32", None, False,
    ),
    Method("onebit_adam", "DDP + OneBitAdamCallback(freeze_step=15% of the steps)", "ddp_fp32", 1.0, True),
    Method("actq_4bit", "DDP fp32 + ActivationQuantization(bits=4) (saved activations in 4 bits)", "ddp_fp32", 2.0, False),
)  # fmt: skip
METHOD_BY_NAME = {m.name: m for m in METHODS}
AVERAGING_PERIOD = 4  # post-local SGD's and constant Local SGD's H


@dataclass(frozen=True)
class RunConfig:
    """The settings every method of one fidelity run shares (a resumed run must match them exactly)."""

    preset: str
    steps: int
    eval_every: int
    batch_size: int  # windows per rank per step
    lr: float  # peak
    lr_warmup: int  # linear warm-up steps, then cosine to 10% of the peak
    val_windows: int  # held-out windows evaluated every eval_every steps (a multiple of the world size)
    val_batch_size: int
    corpus_bytes: int  # the first corpus_bytes of the stdlib sources (then split train / validation)
    collective_timeout_s: float


def phase_steps(cfg: RunConfig) -> dict[str, int]:
    """OneBitAdam's freeze step (15% of the steps, DeepSpeed's rule of thumb) and post-local SGD's switch.

    torch's ``PeriodicModelAverager`` averages after optimizer step s (0-based) when (s - switch) % 4 == 0;
    the switch is the latest step <= the lr warm-up with (steps - 1 - switch) % 4 == 0, so the last step is an
    averaging step (the final model is the average) and so is every evaluation step when eval_every % 4 == 0.
    """
    switch = cfg.lr_warmup
    while switch > 0 and (cfg.steps - 1 - switch) % AVERAGING_PERIOD:
        switch -= 1
    return {"onebit_freeze": max(1, round(0.15 * cfg.steps)), "post_local_switch": switch}


def build_method(name: str, cfg: RunConfig) -> tuple[Any, type, dict, list]:
    """(strategy, LightningModule class, its extra kwargs, callbacks) for method ``name`` under ``cfg``."""
    from benchmarks.netbench.build import build_variant

    if name not in METHOD_BY_NAME:
        raise ValueError(f"unknown method {name!r}; known: {sorted(METHOD_BY_NAME)}")
    phases = phase_steps(cfg)
    warmup = {"post_local_sgd": phases["post_local_switch"], "onebit_adam": phases["onebit_freeze"]}.get(name, 0)
    variant = "ddp_fp32" if name == "actq_4bit" else name
    strategy, module_cls, module_kw, callbacks = build_variant(
        variant, warmup=warmup, lr=cfg.lr, lr_warmup=cfg.lr_warmup, timeout_s=cfg.collective_timeout_s
    )
    if name == "actq_4bit":
        from lightning_qcomm import ActivationQuantization

        callbacks = [*callbacks, ActivationQuantization(bits=4)]
    ours = {BenchLM: StdlibLM, BenchLMFSDP2: StdlibLMFSDP2}
    if module_cls not in ours:
        raise TypeError(f"method {name!r}: netbench built {module_cls.__name__}, which has no stdlib counterpart")
    return strategy, ours[module_cls], module_kw, callbacks


@dataclass
class CorpusSplit:
    """Train windows and the fixed validation windows, as ``demo.ByteWindows``."""

    train: Any
    val: Any
    train_bytes: int
    val_bytes: int


def load_corpus(cfg: RunConfig, block_size: int, val_fraction: float = 0.05) -> CorpusSplit:
    """The stdlib bytes split as ``demo.StdlibBytes`` splits them; ``val_windows`` evenly spaced held-out windows."""
    from lightning_qcomm.demo import ByteWindows, stdlib_corpus

    data = torch.frombuffer(bytearray(stdlib_corpus(cfg.corpus_bytes)), dtype=torch.uint8)
    n_val = max(int(len(data) * val_fraction), block_size + 1)
    train, val_all = ByteWindows(data[:-n_val], block_size), ByteWindows(data[-n_val:], block_size)
    if cfg.val_windows > len(val_all):
        raise ValueError(f"val_windows={cfg.val_windows} exceeds the {len(val_all)} held-out windows of the corpus")
    stride = len(val_all) / cfg.val_windows
    val = Subset(val_all, [int(i * stride) for i in range(cfg.val_windows)])
    return CorpusSplit(train, val, len(data) - n_val, n_val)


class _StdlibData:
    """Mixin over ``BenchLM``: stdlib data, seeded shuffling per rank, exact held-out mean loss per evaluation."""

    def attach_data(self, split: CorpusSplit, val_batch_size: int) -> None:
        self.split = split
        self.val_batch_size = val_batch_size
        self.val_curve: list[tuple[int, float]] = []  # (optimizer steps done, validation loss)
        self._val_sum = torch.zeros(2, dtype=torch.float64)

    def train_dataloader(self) -> DataLoader:
        # not Lightning's sampler (seed 0 for every run): the run's seed orders the data, the same for every method
        world, rank = self.trainer.world_size, self.trainer.global_rank
        sampler = DistributedSampler(
            self.split.train, world, rank, shuffle=True, seed=self.hparams.seed, drop_last=True
        )
        return DataLoader(self.split.train, batch_size=self.hparams.batch_size, sampler=sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        world, rank = self.trainer.world_size, self.trainer.global_rank
        # every rank evaluates the same number of windows (FSDP2/QSDP forwards are collectives)
        mine = Subset(self.split.val, list(range(rank, len(self.split.val), world)))
        return DataLoader(mine, batch_size=self.val_batch_size, shuffle=False)

    def on_validation_epoch_start(self) -> None:
        self._val_sum = torch.zeros(2, dtype=torch.float64)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
        self._val_sum += torch.tensor([float(loss), y.numel()], dtype=torch.float64)

    def on_validation_epoch_end(self) -> None:
        import torch.distributed as dist

        total = self._val_sum.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        self.val_curve.append((int(self.trainer.global_step), float(total[0] / total[1])))


class StdlibLM(_StdlibData, BenchLM):
    """``BenchLM`` on the stdlib bytes (DDP, QuantDDP, Local SGD, QSDP, OneBitAdam, ActivationQuantization)."""


class StdlibLMFSDP2(_StdlibData, BenchLMFSDP2):
    """``BenchLMFSDP2`` on the stdlib bytes (the FSDP2 fp32 baseline)."""


__all__ = [
    "METHODS",
    "METHOD_BY_NAME",
    "CorpusSplit",
    "Method",
    "RunConfig",
    "StdlibLM",
    "StdlibLMFSDP2",
    "build_method",
    "load_corpus",
    "phase_steps",
]
