"""QSDPStrategy on 2 CPU ranks (gloo): one spawn runs the 2-rank Trainers, the tests below check its results.

The workers are started with ``torch.multiprocessing.spawn`` and given Lightning's environment variables, so
each Trainer(accelerator="cpu", devices=2) in them joins the same gloo process group (no re-launch per
fit). Bytes are counted by wrapping the torch.distributed functions FSDP2 and the QSDP comms call, so the
ratios below are what was actually handed to torch.distributed, not what the ledger assumes.
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import threading
from pathlib import Path

if __name__ == "__main__":  # run as a script (BENCHMARKS.md's QSDP table), without conftest.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "_helpers"))

import lightning.pytorch as pl  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from _launch import free_port, rank_results, set_rank_env, spawn, write_rank_result  # noqa: E402
from torch import nn  # noqa: E402

from lightning_qcomm.adapters.fsdp2.shim import padded_shard_data  # noqa: E402
from lightning_qcomm.strategies.qsdp import QSDPStrategy, register_qsdp_strategies  # noqa: E402

VOCAB, DIM, HEADS, SEQ, LAYERS = 128, 128, 4, 32, 2
N_SEQ, BATCH = 64, 4  # per rank: 32 sequences -> 8 optimizer steps per epoch
COUNTED = (
    "all_gather_single",
    "all_gather_into_tensor",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
)


# --------------------------------------------------------------------------- model and data
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def token_data(n: int = N_SEQ) -> torch.Tensor:
    """Sequences of an affine recurrence mod VOCAB with 10% random tokens: learnable, not trivial."""
    g = torch.Generator().manual_seed(1234)
    x = torch.empty(n, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        x[:, t + 1] = (5 * x[:, t] + 3) % VOCAB
    noise = torch.rand(n, SEQ + 1, generator=g) < 0.1
    return torch.where(noise, torch.randint(0, VOCAB, x.shape, generator=g), x)


class GPTModule(pl.LightningModule):
    """No configure_model: QSDPStrategy shards it itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyGPT()
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        (seq,) = batch
        logits = self.model(seq[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), seq[:, 1:].reshape(-1))
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.0)

    def train_dataloader(self):
        ds = torch.utils.data.TensorDataset(token_data())
        return torch.utils.data.DataLoader(ds, batch_size=BATCH, shuffle=False)


class GPTModuleFSDP(GPTModule):
    """The user's own configure_model with fully_shard (same grouping as the automatic policy)."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for blk in self.model.blocks:
            fully_shard(blk, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class EmptyModule(GPTModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Identity()

    def configure_optimizers(self):
        return None


# --------------------------------------------------------------------------- worker helpers
class ByteCounter:
    """Wraps the torch.distributed functions that move FSDP buffers and sums the input bytes handed to them."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.bytes = dict.fromkeys(COUNTED, 0)
        self.threads: dict[str, set[str]] = {name: set() for name in COUNTED}
        for name in COUNTED:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            inp = kwargs.get("input_tensor", kwargs.get("input"))
            if inp is None:
                inp = args[1]
            self.bytes[name] += inp.numel() * inp.element_size()
            self.threads[name].add(threading.current_thread().name)
            return fn(*args, **kwargs)

        return counted

    def reset(self) -> None:
        self.bytes = dict.fromkeys(COUNTED, 0)
        self.threads = {name: set() for name in COUNTED}

    def total(self) -> int:
        return sum(self.bytes.values())


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().float().clone().numpy().tobytes()).hexdigest()  # clone: numpy pins storage


def lattice_error(w: torch.Tensor, bits: int, bucket: int = 1024) -> float:
    """Max distance of (w - lo)/unit from an integer over the buckets of a flat tensor (0 on the lattice)."""
    w = w.detach().double().reshape(-1)
    w = w[: (w.numel() // bucket) * bucket].view(-1, bucket)
    lo, hi = w.min(dim=1, keepdim=True).values, w.max(dim=1, keepdim=True).values
    t = (w - lo) / ((hi - lo).clamp_min(1e-30) / ((1 << bits) - 1))
    return float((t - t.round()).abs().max())


class WeightProbe:
    """Records digests of blocks[0].fc's gathered weight in forward and backward, and its lattice error."""

    def __init__(self, module: nn.Module, rank: int, bits: int) -> None:
        self.fwd: list[str] = []
        self.bwd: list[str] = []
        self.lattice = -1.0
        self.full_shape = None
        rows = 4 * DIM // 2

        def fwd_hook(mod, args):
            w = mod.weight
            self.full_shape = tuple(w.shape)
            self.fwd.append(_digest(w))
            if self.lattice < 0:  # this rank's own slice, as it came back from the all-gather
                self.lattice = lattice_error(w[rank * rows : (rank + 1) * rows], bits)

        def bwd_hook(mod, grad_out):
            self.bwd.append(_digest(mod.weight))

        module.register_forward_pre_hook(fwd_hook)
        module.register_full_backward_pre_hook(bwd_hook)


class SaveAfterFirstEpoch:
    """Saves a sharded and a full checkpoint at the end of the first epoch (mid-run, like ModelCheckpoint)."""

    def __new__(cls, paths: dict[str, str]):
        import lightning.pytorch as pl

        class _Cb(pl.Callback):
            def on_train_epoch_end(self, trainer, pl_module):
                if trainer.current_epoch != 0:
                    return
                for kind, path in paths.items():
                    trainer.strategy._save_distributed_checkpoint = kind == "sharded"
                    trainer.save_checkpoint(path)
                trainer.strategy._save_distributed_checkpoint = True

        return _Cb()


def _worker(rank: int, world: int, port: int, outdir: str) -> None:
    import warnings

    import torch.distributed as dist
    from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry

    from lightning_qcomm.comm.ledger import CommLedger, set_ledger

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    register_qsdp_strategies(StrategyRegistry)
    counter = ByteCounter()
    res: dict = {}

    def fit(
        name, strategy, module_cls=GPTModule, epochs=2, precision="32-true", probe_bits=8, ckpt_path=None, callbacks=()
    ):
        set_rank_env(rank, world, port)
        counter.reset()
        ledger = CommLedger()
        set_ledger(ledger)
        module = module_cls()
        probe = WeightProbe(module.model.blocks[0].fc, rank, probe_bits) if hasattr(module.model, "blocks") else None
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=strategy,
            precision=precision,
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            callbacks=list(callbacks),
        )
        trainer.fit(module, ckpt_path=ckpt_path)
        totals = ledger.summarize(ledger.cumulative, by="op")
        out = {
            "losses": module.losses,
            "bytes": dict(counter.bytes),
            "bytes_total": counter.total(),
            "threads": {k: sorted(v) for k, v in counter.threads.items()},
            "ledger_payload": {k: v.payload_bytes for k, v in totals.items()},
            "ledger_ratio": {k: v.ratio for k, v in totals.items()},
            "global_step": trainer.global_step,
        }
        if isinstance(trainer.strategy, QSDPStrategy):
            out["rng_step"] = trainer.strategy.comm_state.step
        if probe is not None:
            out.update(fwd=probe.fwd, bwd=probe.bwd, lattice=probe.lattice)
        res[name] = out
        return trainer, module

    fit("plain", ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1), GPTModuleFSDP)
    fit("q32", QSDPStrategy(bits=32))
    ckpt_paths = {"sharded": os.path.join(outdir, "ckpt_sharded"), "full": os.path.join(outdir, "ckpt_full.ckpt")}
    fit("w8g8", "qsdp", callbacks=[SaveAfterFirstEpoch(ckpt_paths)])
    fit("w4g4", "qsdp_w4g4", probe_bits=4)
    fit("w8g8_inline", QSDPStrategy(bits=8, overlap_comm=False))
    fit("user_cm", QSDPStrategy(bits=8), GPTModuleFSDP)
    # checkpoint: the w8g8 run saved sharded and full checkpoints after epoch 1; fresh Trainers resume them
    for kind, distributed in (("sharded", True), ("full", False)):
        strategy = QSDPStrategy(bits=8, save_distributed_checkpoint=distributed)
        fit(f"{kind}_b", strategy, epochs=2, ckpt_path=ckpt_paths[kind])
    trainer, _ = fit(
        "master_bf16",
        QSDPStrategy(bits=8, quantize_master=True, layer_classes="Block"),
        precision="bf16-mixed",
        epochs=1,
    )
    errs = []
    for m in trainer.strategy._fsdp_modules:
        for info, data in padded_shard_data(m):
            if info.ndim >= 2 and info.numel >= 1024:
                errs.append(lattice_error(data, 8))
    res["master_bf16"]["master_lattice"] = max(errs)
    # every rank's view of the gathered weights, for the cross-rank identity check
    gathered: list = [None] * world
    dist.all_gather_object(gathered, {k: (v.get("fwd"), v.get("bwd")) for k, v in res.items()})
    res["digests_all_ranks"] = gathered
    try:  # both ranks fail in setup, before any collective, so the group stays usable
        fit("empty", QSDPStrategy(bits=8), module_cls=EmptyModule, epochs=1)
        res["empty_error"] = ""
    except ValueError as err:
        res["empty_error"] = str(err)
    write_rank_result(outdir, rank, res)


def _spawn(world: int, tmp_path) -> list[dict]:
    os.environ["OMP_NUM_THREADS"] = "1"
    spawn(_worker, world, free_port(), str(tmp_path), nprocs=world)
    return rank_results(tmp_path, world)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _spawn(2, tmp_path_factory.mktemp("qsdp2"))


# --------------------------------------------------------------------------- tests on the 2-rank results
def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _final(losses: list[float], k: int = 4) -> float:
    return sum(losses[-k:]) / k


@pytest.mark.slow
def test_trains_and_unquantized_equals_plain_fsdp2(two_ranks):
    for r in two_ranks:
        plain = r["plain"]["losses"]
        assert len(plain) == 16 and r["plain"]["global_step"] == 16
        assert _final(plain) < 0.6 * plain[0], plain  # the task is learnable
        q32 = r["q32"]["losses"]
        assert len(q32) == len(plain)
        for a, b in zip(q32, plain):
            assert _rel(a, b) < 1e-5, (q32, plain)
        assert r["q32"]["lattice"] > 0.05  # unquantized weights are not on an 8-bit lattice


@pytest.mark.slow
def test_w8g8_loss_close_to_fsdp2_and_w4g4_trains(two_ranks):
    for r in two_ranks:
        plain, w8 = r["plain"]["losses"], r["w8g8"]["losses"]
        assert w8 != plain  # quantization happened
        assert _rel(_final(w8), _final(plain)) < 0.02, (w8, plain)
        w4 = r["w4g4"]["losses"]
        assert all(math.isfinite(x) for x in w4) and _final(w4) < 0.8 * w4[0], w4


@pytest.mark.slow
def test_bytes_handed_to_torch_distributed(two_ranks):
    for r in two_ranks:
        base = r["plain"]["bytes_total"]
        # FSDP2's own reduce-scatter: reduce_scatter_single from torch 2.13, reduce_scatter_tensor before
        assert (
            base > 0 and r["plain"]["bytes"]["reduce_scatter_single"] + r["plain"]["bytes"]["reduce_scatter_tensor"] > 0
        )
        assert r["q32"]["bytes_total"] == base  # unquantized path: same bytes as FSDP2 fp32
        for name, limit in (("w8g8", 0.27), ("w4g4", 0.14)):
            counted = r[name]["bytes_total"]
            assert counted / base <= limit, (name, counted / base)
            # the ledger's payload is exactly what was handed over (all-gather input + all-to-all input)
            led = r[name]["ledger_payload"]
            assert led["all_gather"] + led["reduce_scatter"] == counted
            # grads went through the quantized all-to-all
            assert r[name]["bytes"]["reduce_scatter_single"] == r[name]["bytes"]["reduce_scatter_tensor"] == 0


@pytest.mark.slow
def test_gathered_weights_identical_and_consistent(two_ranks):
    for name in ("w8g8", "w4g4", "user_cm"):
        per_rank = two_ranks[0]["digests_all_ranks"]
        fwd0, bwd0 = per_rank[0][name]
        fwd1, bwd1 = per_rank[1][name]
        assert fwd0 == fwd1 and bwd0 == bwd1  # every rank computes with the same weights
        assert len(fwd0) == 16 and len(bwd0) == 16
        assert fwd0 == bwd0  # the backward re-gather sees the forward's quantized weights
        assert len(set(fwd0)) == 16  # and they change every step
        for r in two_ranks:
            assert r[name]["lattice"] < 1e-3, (name, r[name]["lattice"])  # weights travelled quantized


@pytest.mark.slow
def test_overlapped_all_gather_is_bit_identical_to_inline(two_ranks):
    """overlap_comm=True (the default on CPU) gathers weights and reduce-scatters gradients on the worker thread
    over its own group and prefetches; losses and the gathered weights equal the inline path's bit for bit."""
    for r in two_ranks:
        ov, inline = r["w8g8"], r["w8g8_inline"]
        gathers_ov = ov["threads"]["all_gather_single"] + ov["threads"]["all_gather_into_tensor"]
        gathers_in = inline["threads"]["all_gather_single"] + inline["threads"]["all_gather_into_tensor"]
        assert "lightning_qcomm-qsdp" in gathers_ov, ov["threads"]
        assert "lightning_qcomm-qsdp" not in gathers_in, inline["threads"]
        # the gradient reduce-scatters too, finished at the end of backward (adapters.fsdp2.deferred)
        assert ov["threads"]["all_to_all_single"] == ["lightning_qcomm-qsdp"], ov["threads"]
        assert inline["threads"]["all_to_all_single"] == ["MainThread"], inline["threads"]
        assert ov["losses"] == inline["losses"]
        assert ov["fwd"] == inline["fwd"] and ov["bwd"] == inline["bwd"]
        assert ov["bytes_total"] == inline["bytes_total"]


@pytest.mark.slow
def test_user_configure_model_gets_quantized_comms(two_ranks):
    for r in two_ranks:
        # same grouping and group ids as the automatic policy -> the same seeds and bit-identical losses
        assert r["user_cm"]["losses"] == r["w8g8"]["losses"]
        assert r["user_cm"]["bytes_total"] == r["w8g8"]["bytes_total"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_checkpoint_resume_continues_trajectory(two_ranks, kind):
    for r in two_ranks:
        ref = r["w8g8"]["losses"]
        resumed = r[f"{kind}_b"]["losses"]
        assert len(resumed) == 8 and r[f"{kind}_b"]["global_step"] == 16 and r[f"{kind}_b"]["rng_step"] == 16
        for a, b in zip(resumed, ref[8:]):
            assert _rel(a, b) < 1e-6, (resumed, ref[8:])


@pytest.mark.slow
def test_bf16_mixed_with_quantize_master(two_ranks):
    for r in two_ranks:
        losses = r["master_bf16"]["losses"]
        assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
        assert _final(losses) < 0.9 * losses[0]
        assert r["master_bf16"]["master_lattice"] < 1e-3  # master shards sit on the 8-bit lattice


# --------------------------------------------------------------------------- row codec (no processes)
@pytest.mark.parametrize("bucket", [8, 7, None])
def test_row_codec_segments(bucket):
    """Mixed raw/quantized segments: raw ones are bit-exact, quantized ones equal the codec's own round trip
    (batched over rows when bucket boundaries align with rows, per row otherwise), sizes match row_nbytes."""
    from lightning_qcomm.adapters.fsdp2.comms import RowCodec, Segment
    from lightning_qcomm.codecs import derive_seed, get_codec

    codec = get_codec("uniform" if bucket else "sign1", bits=4 if bucket else 1, bucket_size=bucket)
    segs = [Segment(16, True), Segment(5, False), Segment(0, True), Segment(13, True)]
    rc = RowCodec(segs, codec)
    rows = torch.randn(3, rc.row_numel, generator=torch.Generator().manual_seed(0))
    buf = rc.encode(rows, seed=11)
    assert buf.dtype == torch.uint8 and tuple(buf.shape) == (3, rc.row_nbytes(torch.float32))
    out = torch.empty_like(rows)
    rc.decode(buf, out)
    assert torch.equal(out[:, 16:21], rows[:, 16:21])
    for k, (lo, hi) in enumerate([(0, 16), (21, 34)]):
        seg_seed = derive_seed(11, 0 if k == 0 else 2)  # index among non-empty segments: 0 and 2
        n = hi - lo
        if rc._aligned(n, 3):
            ref = codec.roundtrip(rows[:, lo:hi].reshape(-1), seg_seed).view(3, n)
        else:
            ref = torch.stack([codec.roundtrip(rows[r, lo:hi], derive_seed(seg_seed, r)) for r in range(3)])
        assert torch.equal(out[:, lo:hi], ref)
        assert not torch.equal(out[:, lo:hi], rows[:, lo:hi])
    # skip_row (the reduce-scatter's own row): that row is left alone, the others decode the same
    partial = torch.full_like(rows, 7.0)
    rc.decode(buf, partial, skip_row=1)
    assert torch.equal(partial[1], torch.full_like(rows[1], 7.0))
    assert torch.equal(partial[0], out[0]) and torch.equal(partial[2], out[2])


# --------------------------------------------------------------------------- world size 1, bad input
def _spawn_trainer(module: pl.LightningModule) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=QSDPStrategy(bits=8, start_method="spawn"),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    return trainer


@pytest.mark.slow
def test_world_size_one_with_lightning_spawn_launcher():
    """devices=1 through Lightning's own spawn launcher: trains, and the main process gets the full weights back."""
    module = GPTModule()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = _spawn_trainer(module)
    loss = float(trainer.callback_metrics["train_loss"])
    assert math.isfinite(loss) and loss < 0.8 * math.log(VOCAB)
    after = module.state_dict()
    assert set(after) == set(before)
    assert all(not torch.equal(after[k], before[k]) for k in before if k.endswith("weight"))


@pytest.mark.slow
def test_spawn_launcher_leaves_no_weights_file_behind_when_the_main_process_fails(tmp_path, monkeypatch):
    """The spawn launcher hands the trained full weights to the main process through a file; a failure
    while the main process takes them (here: loading raises) must not leave that full-size file behind."""
    import tempfile

    from lightning_qcomm.strategies.qsdp_checkpoint import FullStateLauncher

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR here and in the spawned worker

    def fail(self, worker_output, trainer):
        assert worker_output.weights_path and os.path.isfile(worker_output.weights_path)
        raise RuntimeError("main process died while loading the weights")

    monkeypatch.setattr(FullStateLauncher, "_recover_results_in_main_process", fail)
    with pytest.raises(RuntimeError, match="died while loading"):
        _spawn_trainer(GPTModule())
    left = [p for p in tmp_path.rglob("*") if p.is_file() and p.suffix == ".ckpt"]
    assert not left, left


@pytest.mark.slow
def test_model_without_parameters_is_rejected(two_ranks):
    for r in two_ranks:
        assert "has no parameters" in r["empty_error"], r["empty_error"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"bits": 9}, r"QSDPStrategy\(bits=9\) is not supported by weight_codec=.uniform.; allowed: 1..8"),
        ({"weight_bits": 0}, "weight_bits=0"),
        ({"grad_bits": 16}, "grad_bits=16"),
        ({"grad_codec": "qsgd", "grad_bits": 1}, "grad_bits=1"),
        ({"weight_codec": "lz4"}, "weight_codec='lz4'"),
        ({"grad_codec": "nope"}, "grad_codec='nope'"),
        ({"bucket_size": 0}, "bucket_size"),
        ({"min_quant_numel": -1}, "min_quant_numel"),
        ({"start_method": "thread"}, "start_method"),
        ({"bits": 32, "quantize_master": True}, "quantize_master"),
        ({"layer_classes": " , "}, "layer_classes"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QSDPStrategy(**kwargs)


@pytest.mark.parametrize("kwargs", [{"overlap_comm": "yes"}, {"reshard_after_forward": 1}, {"bits": 8.0}])
def test_bad_argument_types(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(TypeError, match=name):
        QSDPStrategy(**kwargs)


def test_auto_shard_targets():
    from lightning_qcomm.parallel.sharding import plan_fsdp_groups

    model = TinyGPT()
    # default: ModuleList elements with params, then the root's children with params left (here: all of
    # TinyGPT's own tensors are in its children); TinyGPT holds no parameter itself, so it is no group
    assert plan_fsdp_groups(model, None, 10**6) == [*model.blocks, model.tok, model.pos, model.ln_f, model.head]
    b0, b1 = model.blocks
    # deepest first (the blocks' norms, then the blocks, then ln_f), then the children left (tok, pos, head)
    assert plan_fsdp_groups(model, "Block, LayerNorm", 10**6) == [
        *(b0.ln1, b0.ln2, b1.ln1, b1.ln2, b0, b1, model.ln_f),
        *(model.tok, model.pos, model.head),
    ]
    with pytest.raises(ValueError, match="Attention"):
        plan_fsdp_groups(model, "Block,Attention", 10**6)


def test_bits_resolution_and_registry():
    from lightning.fabric.strategies.registry import _StrategyRegistry

    s = QSDPStrategy(bits=4, grad_bits=8)
    assert (s.weight_codec.bits, s.grad_codec.bits) == (4, 8)
    s = QSDPStrategy(bits=32)
    assert s.weight_codec is None and s.grad_codec is None
    s = QSDPStrategy()
    assert (s.weight_codec.bits, s.grad_codec.bits, s.weight_codec.bucket_size) == (8, 8, 1024)
    with pytest.raises(TypeError, match="bits"):
        QSDPStrategy(bits=8.0)
    reg = _StrategyRegistry()
    register_qsdp_strategies(reg)
    register_qsdp_strategies(reg)  # idempotent
    assert {"qsdp", "qsdp_w8g8", "qsdp_w4g4"} <= set(reg)
    w4 = reg.get("qsdp_w4g4")
    assert isinstance(w4, QSDPStrategy) and (w4.weight_bits, w4.grad_bits) == (4, 4)


def test_sharded_save_is_atomic_on_overwrite(tmp_path, monkeypatch):
    """A save interrupted while it overwrites ``last.ckpt`` (here: the metadata write fails after every shard
    was written) leaves the previous checkpoint whole; the partial one is refused with a clear error; the
    next save replaces the checkpoint. One process, no process group: the strategy's collectives are no-ops."""
    from lightning_qcomm.consolidate import consolidate_checkpoint

    strategy = QSDPStrategy(bits=8)
    path = tmp_path / "last.ckpt"

    def checkpoint(step: int) -> dict:
        return {"state_dict": {"w": torch.full((4,), float(step))}, "optimizer_states": [], "global_step": step}

    def saved(name: str) -> dict:
        return torch.load(consolidate_checkpoint(path, tmp_path / name), weights_only=False)

    strategy.save_checkpoint(checkpoint(1), path)
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if str(f).endswith("meta.pt"):
            raise OSError("disk full (injected)")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="injected"):
        strategy.save_checkpoint(checkpoint(2), path)
    monkeypatch.setattr(torch, "save", real_save)
    first = saved("a.ckpt")
    assert first["global_step"] == 1 and torch.equal(first["state_dict"]["w"], torch.full((4,), 1.0))

    from lightning_qcomm.strategies.qsdp_checkpoint import check_sharded_checkpoint

    check_sharded_checkpoint(path)  # complete
    (partial,) = [p for p in tmp_path.iterdir() if p.name.startswith(".last.ckpt")]
    with pytest.raises(ValueError, match="incomplete"):
        check_sharded_checkpoint(partial)
    strategy.save_checkpoint(checkpoint(3), path)
    third = saved("b.ckpt")
    assert third["global_step"] == 3 and torch.equal(third["state_dict"]["w"], torch.full((4,), 3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt", "b.ckpt", "last.ckpt"]  # nothing left over


def test_unsupported_precision_is_refused_at_setup():
    """fp16 AMP (a GradScaler over sharded gradients; on CPU Lightning already turns it into bf16-mixed) and
    64-bit are refused before anything is sharded, naming the precision and the allowed set."""
    from lightning.pytorch.plugins.precision import DoublePrecision, MixedPrecision

    for plugin, name in ((MixedPrecision("16-mixed", "cpu"), "16-mixed"), (DoublePrecision(), "64-true")):
        strategy = QSDPStrategy(bits=8)
        strategy.precision_plugin = plugin
        strategy.model = nn.Linear(2, 2)
        with pytest.raises(ValueError, match=rf"precision='{name}'.*32-true, bf16-mixed, bf16-true, 16-true"):
            strategy.setup(trainer=None)


if __name__ == "__main__":
    # Summary for benchmarks/results/qsdp.md: python tests/strategies/test_qsdp.py
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        r0 = _spawn(2, Path(d))[0]
    base = r0["plain"]["bytes_total"] / len(r0["plain"]["losses"])
    print("| run | steps | first loss | mean loss, last 4 steps | AG+RS bytes/step to torch.distributed | ratio |")
    print("|---|---|---|---|---|---|")
    for name in ("plain", "q32", "w8g8", "w4g4", "user_cm", "sharded_b", "full_b", "master_bf16"):
        v = r0[name]
        losses = v["losses"]
        per_step = v["bytes_total"] / len(losses)
        row = f"| {name} | {len(losses)} | {losses[0]:.4f} | {_final(losses):.4f} | {per_step:,.0f} | {per_step / base:.4f} |"
        print(row)
