"""The shared benchmark model: a small GPT-style causal LM on a synthetic Markov-chain token stream.

Owns the model (``GPT``), its data (``MarkovTokens``) and the LightningModule the benchmarks train
(``BenchLM``, plus ``BenchLMFSDP2`` which shards itself with ``fully_shard`` for Lightning's
``ModelParallelStrategy``). Nothing here knows about compression.

Data: each token t has ``branching`` successors drawn once from a seeded generator, with random
weights, so the next-token entropy is at most ln(branching) nats; a model that learns the chain
drives the loss from ln(vocab) towards that floor. Train and validation sequences come from the same
chain with different seeds.

Optimizer: AdamW with linear warm-up then cosine decay to 10% of the peak, stepped per optimizer
step (LocalSGD's QSR rule reads this learning rate).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset


@dataclass(frozen=True)
class GPTConfig:
    """Size of the model and of one training sample."""

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 256
    n_layer: int = 4
    n_head: int = 4
    mlp_ratio: int = 4


# "bench" has ~3.3M parameters (12.1 MiB of fp32 gradients): docs/design.md ("Benchmark regime") asks for >= 3M.
MODEL_PRESETS: dict[str, GPTConfig] = {
    "bench": GPTConfig(),
    "small": GPTConfig(vocab_size=128, seq_len=32, d_model=128, n_layer=2, n_head=4),
    "tiny": GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_layer=1, n_head=2),
    # byte-level (vocab 256) presets of benchmarks/fidelity.py: "fidelity" (~0.9M parameters) is sized so its
    # full run (26 runs of 2000 steps on 2 cores) fits the budget; "fidelity_smoke" is its test size
    "fidelity": GPTConfig(vocab_size=256, seq_len=128, d_model=128, n_layer=4, n_head=4),
    "fidelity_smoke": GPTConfig(vocab_size=256, seq_len=32, d_model=32, n_layer=1, n_head=2),
}


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, cfg.mlp_ratio * d)
        self.out = nn.Linear(cfg.mlp_ratio * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no mask buffer: DDP broadcasts buffers
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + learned position embeddings, ``n_layer`` blocks, final LayerNorm, untied LM head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class MarkovTokens(Dataset):
    """``n`` sequences of ``seq_len + 1`` tokens from a sparse random Markov chain (see module doc)."""

    def __init__(self, vocab_size: int, seq_len: int, n: int, seed: int, branching: int = 4, chain_seed: int = 1234):
        if branching < 1 or branching > vocab_size:
            raise ValueError(f"branching must be in [1, vocab_size={vocab_size}], got {branching}")
        g = torch.Generator().manual_seed(chain_seed)
        succ = torch.stack([torch.randperm(vocab_size, generator=g)[:branching] for _ in range(vocab_size)])
        gs = torch.Generator().manual_seed(seed)
        w = torch.rand(vocab_size, branching, generator=g) + 0.25
        w = w / w.sum(dim=1, keepdim=True)
        seqs = torch.empty(n, seq_len + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(vocab_size, (n,), generator=gs)
        for t in range(1, seq_len + 1):
            choice = torch.multinomial(w[seqs[:, t - 1]], 1, generator=gs).squeeze(1)
            seqs[:, t] = succ[seqs[:, t - 1], choice]
        self.seqs = seqs

    def __len__(self) -> int:
        return self.seqs.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seqs[i]
        return s[:-1], s[1:]


class BenchLM(pl.LightningModule):
    """GPT trained with AdamW + warm-up/cosine; logs ``train_loss`` per step and ``val_loss``.

    ``self.train_losses`` keeps every step's local loss (floats) so a harness can read the curve
    without a logger.
    """

    def __init__(
        self,
        preset: str = "bench",
        lr: float = 2e-3,
        total_steps: int = 30,
        warmup_steps: int = 3,
        weight_decay: float = 0.0,
        batch_size: int = 4,
        n_train: int = 4096,
        n_val: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if preset not in MODEL_PRESETS:
            raise ValueError(f"preset must be one of {sorted(MODEL_PRESETS)}, got {preset!r}")
        self.save_hyperparameters()
        self.cfg = MODEL_PRESETS[preset]
        self.model = GPT(self.cfg)
        self.train_losses: list[float] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def training_step(self, batch, batch_idx):  # noqa: D102
        loss = self._loss(batch)
        self.train_losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):  # noqa: D102
        self.log("val_loss", self._loss(batch), on_epoch=True, sync_dist=False, prog_bar=False)

    def configure_optimizers(self):  # noqa: D102
        hp = self.hparams
        opt = torch.optim.AdamW(self.parameters(), lr=hp.lr, weight_decay=hp.weight_decay)

        def factor(step: int) -> float:
            if step < hp.warmup_steps:
                return (step + 1) / hp.warmup_steps
            frac = min(1.0, (step - hp.warmup_steps) / max(1, hp.total_steps - hp.warmup_steps))
            return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * frac))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self):  # noqa: D102
        hp = self.hparams
        ds = MarkovTokens(self.cfg.vocab_size, self.cfg.seq_len, hp.n_train, seed=hp.seed)
        return torch.utils.data.DataLoader(ds, batch_size=hp.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):  # noqa: D102
        hp = self.hparams
        ds = MarkovTokens(self.cfg.vocab_size, self.cfg.seq_len, hp.n_val, seed=hp.seed + 10_000)
        return torch.utils.data.DataLoader(ds, batch_size=max(hp.batch_size, 8), shuffle=False)

    def describe(self) -> dict:
        return {"preset": self.hparams.preset, **asdict(self.cfg), "params": num_params(self.model)}


class BenchLMFSDP2(BenchLM):
    """``BenchLM`` that applies FSDP2 itself in ``configure_model`` (for ``ModelParallelStrategy``):
    one ``fully_shard`` group per block, then the root. ``mp_dtype`` ("bfloat16") sets a
    ``MixedPrecisionPolicy`` so parameters are gathered and gradients reduced in that dtype.
    ``hsdp_shape`` = (nodes, ranks per node) shards on a 2-D ("replicate", "shard") mesh instead (HSDP:
    parameters sharded inside a node, gradients all-reduced across nodes)."""

    def __init__(self, *args, mp_dtype: str | None = None, hsdp_shape: tuple[int, int] | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if mp_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(f"mp_dtype must be None, 'bfloat16' or 'float16', got {mp_dtype!r}")
        self.mp_dtype = mp_dtype
        self.hsdp_shape = None if hsdp_shape is None else tuple(int(n) for n in hsdp_shape)

    def configure_model(self) -> None:  # noqa: D102
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        if self.hsdp_shape is not None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh("cpu", self.hsdp_shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = self.device_mesh["data_parallel"]
        kw = {"mesh": mesh}
        if self.mp_dtype is not None:
            dt = getattr(torch, self.mp_dtype)
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=dt)
        for blk in self.model.blocks:
            fully_shard(blk, **kw)
        fully_shard(self.model, **kw)
