"""ActivationQuantization (callback) and lightning_qcomm.memory (quantizer, recompute, bit allocation).

Single process: saved-bytes accounting against the codec formula, what is (never) quantized (parameters decided
from storages by the test; a computed weight of the input's size), unbiasedness and error bounds of the gradients
derived from the codec (Hoeffding / |δ| < unit / variance), recompute versus hook path, retain_graph, non-finite
propagation and calibration, policies, checkpointed plans checked against the policy, seeds, argument
validation, the CLI config; Lightning lifecycle: validation untouched, resume with ckpt_path, a skipped batch end
(-1), an exception, manual optimization with two optimizers, FP8 gradient storage seen by the module's hooks.
One 2-rank spawn (gloo): Lightning DDP with and without the callback (loss band), budget calibration
agreeing across ranks, and QSDP (FSDP2) with the callback.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from _launch import free_port, rank_results, spawn, write_rank_result
from torch import nn

from lightning_qcomm.callbacks import ActivationQuantization
from lightning_qcomm.codecs import derive_seed, get_codec
from lightning_qcomm.memory import (
    ActivationQuantConfig,
    ActivationQuantizer,
    budget_plan,
    count_saved_tensors,
    is_parameter_like,
    layer_aware_plan,
    quantize_activation,
    recompute_from_stored,
)
from lightning_qcomm.memory.bit_allocation import average_bits, error_at

REPO = Path(__file__).resolve().parents[2]
QUANT_OPS = {"linear", "layer_norm", "rms_norm", "gelu", "silu"}


# ----------------------------------------------------------------------------------------- a test model


class Attn(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Net(nn.Module):
    """LayerNorm -> attention ('attn') -> LayerNorm -> GELU MLP -> RMSNorm -> SiLU MLP -> MHA -> head."""

    def __init__(self, d: int = 64, heads: int = 4, vocab: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attn(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.rms = nn.RMSNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.act = nn.SiLU()
        self.down = nn.Linear(2 * d, d)
        self.mha = nn.MultiheadAttention(d, heads, batch_first=True)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        x = x + self.down(self.act(self.up(self.rms(x))))
        x = x + self.mha(x, x, x, need_weights=False)[0]
        return self.head(x)


def _net_and_data(seed: int = 0):
    torch.manual_seed(seed)
    net = Net()
    idx = torch.randint(0, 32, (4, 32))
    return net, idx


def _loss(net, idx):
    logits = net(idx)
    return F.cross_entropy(logits.flatten(0, 1), idx.flatten())


class _QuantizedStorages:
    """Wraps the quantizer's ``quantize_activation``: counts the quantized tensors and, deciding parameter-ness
    itself from storages (not with the quantizer's rule), those that share a parameter's storage. Under FSDP2
    ``params()`` is read at each call, i.e. while the module's unsharded parameters are registered."""

    def __init__(self, params):
        import lightning_qcomm.memory.quantizer as qmod

        self.qmod, self.orig, self.params = qmod, qmod.quantize_activation, params
        self.quantized = 0
        self.weights = 0

    def __enter__(self):
        self.qmod.quantize_activation = self._wrapped
        return self

    def __exit__(self, *exc):
        self.qmod.quantize_activation = self.orig

    def _wrapped(self, t, codec, seed):
        from torch.distributed.tensor import DTensor

        ptrs = {(p._local_tensor if isinstance(p, DTensor) else p).untyped_storage().data_ptr() for p in self.params()}
        self.quantized += 1
        self.weights += t.untyped_storage().data_ptr() in ptrs
        return self.orig(t, codec, seed)


def _quantized_grads(net, idx, **cfg):
    q = ActivationQuantizer(ActivationQuantConfig(**cfg))
    q.attach(net)
    q.record = True
    net.zero_grad()
    with q.forward_context(step=0):
        loss = _loss(net, idx)
    loss.backward()
    q.detach()
    return {n: p.grad.clone() for n, p in net.named_parameters()}, q


# ----------------------------------------------------------------------------------------- accounting


def test_saved_bytes_match_codec_formula_and_baseline():
    net, idx = _net_and_data()
    with count_saved_tensors() as plain:
        loss = _loss(net, idx)
    del loss
    _, q = _quantized_grads(net, idx, bits=4, block_size=128, min_numel=1024)
    codec = get_codec("uniform", bits=4, bucket_size=128)
    quantized = [r for r in q.records if r.action == "quantized"]
    # the sites follow from Net's structure (4·32 = 128 rows, d = 64): ln1, the attention's qkv and proj
    # projection inputs, ln2, mlp.0 inputs (d), the GELU and mlp.2 inputs (4d), rms and up inputs (d), the SiLU
    # and down inputs (2d), the head input (d); SDPA's and MultiheadAttention's own saves and the loss exact
    expected = [
        ("ln1", 64), ("attn.qkv", 64), ("attn.proj", 64), ("ln2", 64), ("mlp.0", 64), ("mlp.1", 256),
        ("mlp.2", 256), ("rms", 64), ("up", 64), ("act", 128), ("down", 128), ("head", 64),
    ]  # fmt: skip
    assert [(r.module, r.shape[-1]) for r in quantized] == expected
    assert all(math.prod(r.shape) == 128 * r.shape[-1] for r in quantized)
    numels = [128 * d for _, d in expected]
    # exact: Σ (ceil(n/8)·b + ceil(n/B)·2·4) bytes over the quantized saves, against 4 bytes per fp32 element
    assert q.stats.quantized_stored == sum(codec.nbytes(n) for n in numels)
    assert q.stats.quantized_baseline == 4 * 128 * 1280
    # all numels here are multiples of 8·128, so the ratio is exactly b/32 + 64/(32·B)
    assert all(n % 1024 == 0 for n in numels)
    assert q.stats.quantized_ratio == pytest.approx(4 / 32 + 64 / (32 * 128), rel=1e-12)
    # the kept tensors are counted at full size: stored - quantized_stored == baseline - quantized_baseline
    assert q.stats.stored - q.stats.quantized_stored == q.stats.baseline - q.stats.quantized_baseline
    # the baseline equals what plain autograd saves, less what a recomputed norm no longer saves besides its
    # input (LayerNorm: per-row mean and rstd; the composite CPU RMSNorm: x², x·r, r, ...), measured in isolation
    x = torch.randn(idx.numel(), 64).requires_grad_(True) * 1.0
    extra = 0
    for norm in (net.ln1, net.ln2, net.rms):
        with count_saved_tensors() as alone:
            norm(x)
        extra += alone.baseline - x.numel() * 4
    assert extra > 0
    assert plain.baseline - q.stats.baseline == extra
    assert q.stats.ratio < 0.6


# ----------------------------------------------------------------------------------------- what is quantized


def test_attention_and_parameters_are_never_quantized():
    net, idx = _net_and_data()
    with _QuantizedStorages(net.parameters) as guard:
        _, q = _quantized_grads(net, idx, bits=4)
    assert guard.quantized == q.stats.quantized_tensors > 0 and guard.weights == 0
    recs = q.records
    quantized = [r for r in recs if r.action == "quantized"]
    assert {r.op for r in quantized} == QUANT_OPS
    # every Linear call saved its weight (a view of the parameter) and it was kept: one record per call
    linear_calls = sum(isinstance(m, nn.Linear) for m in net.modules())  # each runs once; MHA's out_proj uses F.mha
    assert len([r for r in recs if r.parameter and r.op == "linear"]) == linear_calls - 1
    # SDPA's Q, K, V, output and log-sum-exp, and all of MultiheadAttention's saves: kept as attention
    sdpa = [r for r in recs if r.op == "scaled_dot_product_attention"]
    assert len(sdpa) >= 4 and all(r.action == "kept" and r.reason == "attention" for r in sdpa)
    mha = [r for r in recs if r.module == "mha" and not r.parameter]
    assert mha and all(r.action == "kept" and r.reason == "attention" for r in mha)
    # the projections around SDPA are projections: their inputs are quantized, whatever the module's name
    inner = [r for r in recs if r.module in ("attn.qkv", "attn.proj") and not r.parameter]
    assert len(inner) == 2 and all(r.action == "quantized" for r in inner)
    # the loss' log-softmax output stays exact, as a loss
    assert any(r.op == "cross_entropy" and r.reason == "loss" and r.shape == (128, 32) for r in recs)


def test_attention_patterns_are_configurable():
    net, idx = _net_and_data()
    _, q = _quantized_grads(net, idx, bits=4, attention_patterns=("*attn*",))
    inner = [r for r in q.records if r.module in ("attn.qkv", "attn.proj") and not r.parameter]
    assert all(r.action == "kept" and r.reason == "attention" for r in inner) and len(inner) == 2
    assert any(r.action == "quantized" for r in q.records if r.module == "mlp.0")  # outside the pattern
    sdpa = [r for r in q.records if r.op == "scaled_dot_product_attention"]
    assert sdpa and all(r.action == "kept" for r in sdpa)  # the attention op itself: always exact


def test_parameter_views_and_casts_are_parameter_like():
    lin = nn.Linear(64, 64)
    w = lin.weight
    assert is_parameter_like(w) and is_parameter_like(w.t()) and is_parameter_like(w.view(-1).unsqueeze(0).t())
    with torch.enable_grad():
        assert is_parameter_like(w.to(torch.bfloat16).t())  # autocast-style cast chain to AccumulateGrad
        x = torch.randn(8, 64, requires_grad=True) * 2.0
        assert not is_parameter_like(x) and not is_parameter_like(x.t())
        assert not is_parameter_like(w * 2.0)  # a computed tensor is an activation
    # under CPU autocast the saved weight is a bf16 cast of the parameter: kept; the input cast: quantized
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=1))
    q.record = True
    x = torch.randn(32, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), q.forward_context():
        y = lin(x * 1.0)
    y.float().sum().backward()
    lin_recs = [r for r in q.records if r.op == "linear"]
    assert {(r.dtype, r.parameter, r.action) for r in lin_recs} == {
        (torch.bfloat16, True, "kept"),
        (torch.bfloat16, False, "quantized"),
    }
    assert lin.weight.grad is not None and torch.isfinite(lin.weight.grad).all()


def test_small_and_leaf_saves_are_kept():
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=1024))
    q.record = True
    lin = nn.Linear(16, 16)
    leaf = torch.randn(128, 16)  # a leaf (data), 2048 elements: held by its owner anyway
    small = torch.randn(4, 16, requires_grad=True) * 1.0
    with q.forward_context():
        (lin(leaf).sum() + lin(small).sum()).backward()
    reasons = {r.reason for r in q.records if not r.parameter}
    assert reasons == {"not an autograd intermediate", "small"}
    assert q.stats.quantized_tensors == 0


def test_activation_checkpointing_regions_are_left_to_checkpoint():
    """Inside torch.utils.checkpoint (non-reentrant) the checkpoint's hooks decide what is saved: the quantizer
    must not intercept (quantizing there breaks the recompute's metadata check); outside it still quantizes."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    blk = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
    head = nn.Linear(64, 64)
    x = torch.randn(32, 64, requires_grad=True)
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=1))
    q.attach(nn.ModuleDict({"blk": blk, "head": head}))
    q.record = True
    with q.forward_context():
        y = head(checkpoint(blk, x * 1.0, use_reentrant=False))
    y.sum().backward()
    assert [(r.module, r.action) for r in q.records if r.op != "other" and not r.parameter] == [("head", "quantized")]
    assert all(p.grad is not None for p in blk.parameters())


def test_computed_weight_of_the_input_size_is_not_quantized():
    """A weight computed in forward (weight_norm here; merged LoRA and masked weights alike) is no parameter
    view, and with a (64, 64) input it has the input's numel: only the input may be quantized, so
    dX = dY · W is exact (docs/design.md, "Activation quantization") while dW uses the quantized input."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    lin = weight_norm(nn.Linear(64, 64))
    x = torch.randn(64, 64, requires_grad=True)
    g = torch.randn(64, 64)
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=1))
    q.record = True
    with q.forward_context():
        y = lin(x * 1.0)
    (y * g).sum().backward()
    lin_recs = [r for r in q.records if r.op == "linear"]
    assert [r.action for r in lin_recs].count("quantized") == 1, lin_recs
    assert {r.reason for r in lin_recs if r.action == "kept"} == {"not the op input"}
    with torch.no_grad():
        w = lin.weight
    assert torch.allclose(x.grad, g @ w, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("recompute", [True, False])
def test_second_backward_through_a_retained_graph(recompute):
    """retain_graph=True (multi-loss / GAN code): the second backward restores the stored codes again and
    equals a fresh run's gradient of the second loss (same seed, so the same x̃)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    x = torch.randn(32, 64, requires_grad=True)
    cfg = ActivationQuantConfig(bits=4, min_numel=1, recompute=recompute)
    with ActivationQuantizer(cfg).forward_context():
        y = net(x * 1.0)
    y.sum().backward(retain_graph=True)
    net.zero_grad()
    x.grad = None
    y.square().sum().backward()
    second = [p.grad.clone() for p in net.parameters()] + [x.grad.clone()]
    net.zero_grad()
    x.grad = None
    with ActivationQuantizer(cfg).forward_context():
        y = net(x * 1.0)
    y.square().sum().backward()
    fresh = [p.grad for p in net.parameters()] + [x.grad]
    assert all(torch.equal(a, b) for a, b in zip(second, fresh))


def test_missing_private_torch_api_turns_quantization_off_with_one_warning(monkeypatch, caplog):
    import lightning_qcomm.memory.quantizer as qmod

    monkeypatch.setattr(qmod, "_TOP_HOOKS", None)
    net, idx = _net_and_data()
    ref = {n: g.clone() for n, g in _plain_grads(net, idx).items()}
    q = ActivationQuantizer(ActivationQuantConfig(bits=4))
    with caplog.at_level("WARNING", logger=qmod.__name__):
        for _ in range(2):
            net.zero_grad()
            with q.forward_context():
                loss = _loss(net, idx)
            loss.backward()
    assert q.stats.quantized_tensors == 0 and not q.active
    assert all(torch.equal(p.grad, ref[n]) for n, p in net.named_parameters())
    assert sum("quantization is OFF" in r.message for r in caplog.records) == 1


def _plain_grads(net, idx):
    net.zero_grad()
    _loss(net, idx).backward()
    return {n: p.grad for n, p in net.named_parameters()}


# ----------------------------------------------------------------------------------------- gradients


def _linear_chain(seed: int = 0):
    torch.manual_seed(seed)
    lin1, lin2 = nn.Linear(128, 128), nn.Linear(128, 64)
    x0 = torch.randn(64, 128, requires_grad=True)  # so that lin1's input x0·1 is an intermediate (quantized)
    c = torch.randn(64, 64)  # L = Σ c ⊙ y: dL/dy = c, independent of the quantization
    return lin1, lin2, x0, c


def _chain_grads(lin1, lin2, x0, c, cfg: ActivationQuantConfig | None):
    lin1.zero_grad()
    lin2.zero_grad()
    if cfg is None:
        y = lin2(lin1(x0 * 1.0))
    else:
        with ActivationQuantizer(cfg).forward_context():
            y = lin2(lin1(x0 * 1.0))
    (y * c).sum().backward()
    return lin1.weight.grad.clone(), lin2.weight.grad.clone()


def test_linear_gradients_unbiased_and_within_codec_bounds():
    """dW2 = cᵀ h̃ and dW1 = (c W2)ᵀ ã are linear in the quantized saves with exact coefficients, so
    E[dW] = dW_fp32. Per seed, |h̃ - h| < unit elementwise gives |ΔdW2[o,i]| <= Σ_n |c[n,o]| unit[n,i].
    Over K seeds, Hoeffding on the K·N independent bounded terms (range |c[n,o]|·unit[n,i]/K) with a union
    bound over all M elements at failure probability 1e-6 bounds |mean - dW_fp32|."""
    lin1, lin2, x0, c = _linear_chain()
    g1, g2 = _chain_grads(lin1, lin2, x0, c, None)
    with torch.no_grad():
        a, h = x0 * 1.0, lin1(x0)
    codec = get_codec("uniform", bits=4, bucket_size=128)
    unit_a = codec.encode(a).scales[:, 1].view(-1, 1).expand(-1, 128).reshape(a.shape)  # one block = one row
    unit_h = codec.encode(h).scales[:, 1].view(-1, 1).expand(-1, 128).reshape(h.shape)
    c1 = c @ lin2.weight.detach()  # dL/dh
    det2 = c.abs().t() @ unit_h
    det1 = c1.abs().t() @ unit_a
    k = 48
    s1, s2 = torch.zeros_like(g1), torch.zeros_like(g2)
    for seed in range(k):
        q1, q2 = _chain_grads(lin1, lin2, x0, c, ActivationQuantConfig(bits=4, block_size=128, seed=seed))
        assert torch.all((q2 - g2).abs() <= det2 * (1 + 1e-5) + 1e-6)
        assert torch.all((q1 - g1).abs() <= det1 * (1 + 1e-5) + 1e-6)
        assert not torch.equal(q2, g2) and not torch.equal(q1, g1)
        s1 += q1
        s2 += q2
    for mean, exact, coef, unit in ((s1 / k, g1, c1, unit_a), (s2 / k, g2, c, unit_h)):
        var_sum = coef.square().t() @ unit.square() / k  # Σ ranges² of the Hoeffding terms
        t = torch.sqrt(var_sum * math.log(2 * exact.numel() / 1e-6) / 2)
        assert torch.all((mean - exact).abs() <= t + 1e-6)
        # the average really averages out: per element Var(mean) = Σ_n c² unit² f(1-f) / k <= Σ_n c² unit² / (4k)
        # (f the fractional position), so E|err| <= sqrt(Σ c² u² / (4k)) (Jensen); the mean over >= 4096 elements
        # stays below 3·sqrt(Σ c² u² / (6k)) = 2.45x that (expected ~0.8·sqrt(Σ c² u² / (6k)) for f ~ U[0, 1)).
        # One draw (k = 1, sqrt(48) = 7x the error) lands ~1.8x above this bound, and round-to-nearest (error
        # variance u²/12, not reduced by averaging) ~1.3x above it: both fail.
        rms_bound = torch.sqrt(coef.square().t() @ unit.square() / (6 * k))
        assert (mean - exact).abs().mean() <= 3 * rms_bound.mean()


def test_runs_are_reproducible_and_seed_dependent():
    net, idx = _net_and_data()
    a, _ = _quantized_grads(net, idx, bits=4, seed=3)
    b, _ = _quantized_grads(net, idx, bits=4, seed=3)
    c, _ = _quantized_grads(net, idx, bits=4, seed=4)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not all(torch.equal(a[n], c[n]) for n in a)
    assert derive_seed(3, 0, 0, 0, 0) != derive_seed(3, 0, 0, 0, 1)


def test_transposed_saves_restore_with_their_strides():
    """A transposed (non-contiguous) input is quantized in logical order and restored into its strides:
    the weight gradient is exactly dYᵀ x̃ with x̃ the site-0 decode of that view."""
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=1))
    q.record = True
    x = torch.randn(64, 96, requires_grad=True)
    w = nn.Parameter(torch.randn(32, 64))
    with q.forward_context():
        xt = (x * 1.0).t()  # (96, 64), strides (1, 96)
        y = F.linear(xt, w)
    y.sum().backward()
    assert [r.action for r in q.records if r.op == "linear" and not r.parameter] == ["quantized"]
    x_tilde = quantize_activation(xt.detach(), q.codec(4), derive_seed(0, 0, 0, 0, 0)).restore()
    assert x_tilde.stride() == xt.stride()
    assert torch.allclose(w.grad, torch.ones(96, 32).t() @ x_tilde, rtol=1e-5, atol=1e-5)
    assert torch.equal(x.grad, (torch.ones(96, 32) @ w.detach()).t())  # dX = dY W does not use the save


# ----------------------------------------------------------------------------------------- recompute


def _norm_input(seed=0):
    torch.manual_seed(seed)
    return (torch.randn(16, 256) * 3 + 1).requires_grad_(True)


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
def test_recompute_norm_is_exact_gradient_at_the_quantized_input(kind):
    """Recompute path: the gradient is exactly autograd's gradient of the norm evaluated at x̃."""
    x = _norm_input()
    mod = nn.LayerNorm(256) if kind == "layer_norm" else nn.RMSNorm(256)
    with torch.no_grad():
        mod.weight.uniform_(0.5, 1.5)
    g = torch.randn(16, 256)
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=1))
    with q.forward_context():
        y = mod(x * 1.0)
    (y * g).sum().backward()
    got_x, got_w = x.grad.clone(), mod.weight.grad.clone()
    # reference: the site-0 seed, the same codec, autograd at x̃
    xt = quantize_activation(x.detach() * 1.0, q.codec(4), derive_seed(0, 0, 0, 0, 0)).restore().requires_grad_(True)
    mod.zero_grad()
    (mod(xt) * g).sum().backward()
    assert torch.allclose(got_x, xt.grad, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got_w, mod.weight.grad, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(got_w, _fp32_norm_grads(mod, x, g)[1], rtol=1e-3)  # quantization did act


def _fp32_norm_grads(mod, x, g):
    x = x.detach().clone().requires_grad_(True)
    mod.zero_grad()
    (mod(x * 1.0) * g).sum().backward()
    return x.grad, mod.weight.grad.clone()


def test_layer_norm_recompute_vs_hook_path_within_derived_bound():
    """Hook path: native backward with x̃ but the exact mean μ and r = 1/σ; recompute: μ̃, r̃ of x̃.
    With δ = x̃ - x, |δ| < u (row's largest unit): x̂_b = (x̃ - μ) r, x̂_a = (x̃ - μ̃) r̃, and
    |r̃/r - 1| <= u r / (1 - u r) (std is a norm: |σ̃ - σ| <= rms(δ - δ̄) <= u), so
    |x̂_a - x̂_b| <= |r̃/r - 1| (|x̂| + 2 u r) + u r, and dw = Σ_n g ⊙ x̂ differs by at most Σ_n |g| · that."""
    x = _norm_input()
    mod = nn.LayerNorm(256, elementwise_affine=True)
    g = torch.randn(16, 256)
    grads = {}
    for recompute in (True, False):
        mod.zero_grad()
        with ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=1, recompute=recompute)).forward_context():
            y = mod(x * 1.0)
        (y * g).sum().backward()
        grads[recompute] = mod.weight.grad.clone()
    codec = get_codec("uniform", bits=4, bucket_size=128)
    u = codec.encode(x.detach()).scales[:, 1].view(16, 2).amax(dim=1, keepdim=True)  # 2 blocks per row
    xd = x.detach()
    mu, var = xd.mean(dim=1, keepdim=True), xd.var(dim=1, unbiased=False, keepdim=True)
    r = 1 / torch.sqrt(var + mod.eps)
    xhat = (xd - mu) * r
    ur = u * r
    assert torch.all(ur < 1)
    per_elem = ur / (1 - ur) * (xhat.abs() + 2 * ur) + ur
    bound = (g.abs() * per_elem).sum(dim=0)
    diff = (grads[True] - grads[False]).abs()
    assert torch.all(diff <= bound * (1 + 1e-4) + 1e-5)
    assert diff.max() > 0  # the two paths are different estimators


@pytest.mark.parametrize("act", ["gelu", "silu", "gelu_tanh"])
def test_activation_recompute_equals_hook_path_exactly(act):
    """GELU/SiLU backward uses only the input, so with the same codes both paths give identical gradients."""
    torch.manual_seed(1)
    x = torch.randn(32, 128, requires_grad=True)
    fn = {"gelu": F.gelu, "silu": F.silu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[act]
    grads = []
    for recompute in (True, False):
        x.grad = None
        q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=1, recompute=recompute))
        q.record = True
        with q.forward_context():
            y = fn(x * 1.0)
        (y * torch.arange(y.numel()).view_as(y).sin()).sum().backward()
        assert [r.action for r in q.records if not r.parameter and r.op != "other"] == ["quantized"]
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm", "gelu", "silu"])
def test_recompute_without_quantization_is_bit_identical_to_torch(kind):
    torch.manual_seed(2)
    x = torch.randn(8, 64, 32).requires_grad_(True)
    w, b = torch.rand(32, requires_grad=True), torch.randn(32, requires_grad=True)
    fn, params = {
        "layer_norm": (lambda t, w_, b_: F.layer_norm(t, (32,), w_, b_, 1e-5), (w, b)),
        "rms_norm": (lambda t, w_: F.rms_norm(t, (32,), w_, 1e-6), (w,)),
        "gelu": (lambda t: F.gelu(t), ()),
        "silu": (lambda t: F.silu(t), ()),
    }[kind]
    g = torch.randn(8, 64, 32)
    h = x * 1.5
    (recompute_from_stored(fn, h, params, stored=h) * g).sum().backward()
    got = [t.grad.clone() for t in (x, *params)]
    for t in (x, *params):
        t.grad = None
    (fn(x * 1.5, *params) * g).sum().backward()
    assert all(torch.equal(a, t.grad) for a, t in zip(got, (x, *params)))


# ----------------------------------------------------------------------------------------- non-finite


@pytest.mark.parametrize("recompute", [True, False])
def test_non_finite_activations_stay_non_finite(recompute):
    x = torch.randn(4, 256)
    x[1, 7] = float("inf")
    x = x.requires_grad_(True)
    stored = quantize_activation(x.detach(), get_codec("uniform", bits=4, bucket_size=128), seed=0)
    back = stored.restore()
    assert torch.isnan(back[1, :128]).all() and torch.isfinite(back[1, 128:]).all() and torch.isfinite(back[0]).all()
    lin, ln = nn.Linear(256, 8), nn.LayerNorm(256)
    with ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=1, recompute=recompute)).forward_context():
        y = lin(F.gelu(ln(x * 1.0) * 1.0))
    y.sum().backward()
    assert not torch.isfinite(lin.weight.grad).all()
    assert not torch.isfinite(x.grad[1]).all()


# ----------------------------------------------------------------------------------------- policies


def test_budget_plan_meets_target_and_favours_sensitive_sites():
    numels = [4096, 4096, 16384, 1024, 8192]
    coefs = [1.0, 1000.0, 1.0, 50.0, 0.1]
    plan = budget_plan(numels, coefs, bits=4, budget_bits=5.0)
    assert set(plan) <= {4, 5, 6, 8}
    assert average_bits(numels, plan) <= 5.0 + 1e-12
    assert plan[1] == 8 and plan[1] >= max(plan)
    assert plan[4] == 4  # least sensitive per element stays at the base width
    # greedy is optimal here: no single feasible change of one site lowers the total error
    total = sum(error_at(c, b) for c, b in zip(coefs, plan))
    for i in range(len(plan)):
        for b in (4, 5, 6, 8):
            alt = plan[:i] + [b] + plan[i + 1 :]
            if average_bits(numels, alt) <= 5.0:
                assert sum(error_at(c, bb) for c, bb in zip(coefs, alt)) >= total - 1e-12
    assert budget_plan(numels, coefs, bits=4, budget_bits=4.0) == [4] * 5
    assert budget_plan(numels, coefs, bits=4, budget_bits=8.0) == [8] * 5
    assert layer_aware_plan(4, 4, 8) == [8, 4, 4, 8]


def test_budget_calibration_measures_sensitivity_end_to_end():
    """Two independent branches; scaling branch 2's Linear output by 30 multiplies its dY (hence G) by 900
    and touches no other site's dY: that site must get strictly the most bits."""

    class TwoBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.c, self.s = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 64)

        def forward(self, x1, x2):
            return self.c(F.gelu(self.a(x1))) + 30.0 * self.s(x2)

    torch.manual_seed(0)
    net = TwoBranch()
    x1, x2 = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64, requires_grad=True)
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, policy="budget", budget_bits=5.0, min_numel=1))
    q.attach(net)
    q.record = True
    assert q.calibrating
    with q.forward_context():
        y = net(x1 * 1.0, x2 * 1.0)
    assert {r.bits for r in q.records if r.action == "quantized"} == {8}  # calibration at 8 bits
    y.square().mean().backward()
    sites = {r.module: r.site for r in q.records if r.action == "quantized"}
    plan = q.finish_calibration()
    assert not q.calibrating and len(plan) == 4 and set(sites) == {"a", "TwoBranch", "c", "s"}
    assert all(plan[sites["s"]] > b for i, b in enumerate(plan) if i != sites["s"]), plan
    assert average_bits([c.numel for c in q.calibration], plan) <= 5.0
    state = q.state_dict()
    q2 = ActivationQuantizer(q.config)
    q2.load_state_dict(json.loads(json.dumps(state)))
    assert q2.plan == plan and not q2.calibrating


def test_layer_aware_widens_first_and_last_site():
    net, idx = _net_and_data()
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, policy="layer_aware", edge_bits=8))
    q.attach(net)
    for _ in range(2):
        q.record = True
        with q.forward_context():
            loss = _loss(net, idx)
        loss.backward()
    bits = [r.bits for r in q.records if r.action == "quantized"]
    assert bits[0] == bits[-1] == 8 and set(bits[1:-1]) == {4}
    assert q.plan == bits


def _calibrated_budget_quantizer(grad_scale: float = 1.0):
    """A budget quantizer after one calibration forward/backward of a small MLP (output gradient × grad_scale)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, policy="budget", budget_bits=5.0, min_numel=1))
    x = torch.randn(64, 64, requires_grad=True)
    with q.forward_context():
        y = net(x * 1.0) * 1.0  # the scaling hook sits downstream of every watched op output
    y.register_hook(lambda g: g * grad_scale)
    y.square().mean().backward()
    return q


def test_budget_calibration_skips_non_finite_gradients():
    """An fp16 overflow step (inf/NaN output gradient) must not turn coefficients into inf/NaN (which made
    budget_plan's gains NaN and leave every site at `bits`, silently): the measurement is skipped and counted."""
    q = _calibrated_budget_quantizer(float("inf"))
    assert q.nonfinite_grads == 3 and all(c.coef == 0.0 for c in q.calibration)
    q.reset_calibration()
    assert q.calibration == [] and q.nonfinite_grads == 0
    ok = _calibrated_budget_quantizer()
    assert ok.nonfinite_grads == 0 and all(math.isfinite(c.coef) and c.coef > 0 for c in ok.calibration)
    with pytest.raises(ValueError, match="coefs"):
        budget_plan([4096, 4096], [1.0, float("nan")], bits=4, budget_bits=5.0)


def test_budget_calibration_refuses_ranks_with_different_site_counts():
    """reduce sums over ranks; a fake 2-rank reduce whose other rank measured one site more must raise (on every
    rank: all see the same sums) before the per-site reduce, which would otherwise mismatch or hang."""
    q = _calibrated_budget_quantizer()
    n = len(q.calibration)
    calls = []

    def other_rank_differs(t):
        calls.append(t.numel())
        return t + torch.tensor([1.0, n + 1, (n + 1) ** 2], dtype=torch.float64)

    with pytest.raises(ValueError, match="different numbers of quantized sites"):
        q.finish_calibration(reduce=other_rank_differs)
    assert calls == [3] and q.plan is None
    # an identical other rank: sizes and coefficients double, the plan is the single-rank one
    single = _calibrated_budget_quantizer().finish_calibration()
    assert q.finish_calibration(reduce=lambda t: 2 * t) == single


def test_checkpoint_plan_is_checked_against_the_policy(caplog):
    la = ActivationQuantizer(ActivationQuantConfig(bits=4, policy="layer_aware"))
    la.plan = [8, 4, 4, 8]
    state = json.loads(json.dumps(la.state_dict()))
    assert state["version"] == 2 and state["policy"] == "layer_aware"
    budget = ActivationQuantizer(ActivationQuantConfig(bits=4, policy="budget"))
    with caplog.at_level("WARNING"):
        budget.load_state_dict(state)
    assert budget.plan is None and budget.calibrating and "discarded" in caplog.text
    other_edges = ActivationQuantizer(ActivationQuantConfig(bits=4, policy="layer_aware", edge_bits=6))
    other_edges.load_state_dict(state)
    assert other_edges.plan is None
    same = ActivationQuantizer(ActivationQuantConfig(bits=4, policy="layer_aware"))
    same.load_state_dict(state)
    assert same.plan == [8, 4, 4, 8] and not same.calibrating
    with pytest.raises(ValueError, match="1..8"):
        same.load_state_dict({**state, "plan": [8, 9]})
    with pytest.raises(ValueError, match="version"):
        same.load_state_dict({**state, "version": 3})
    old = ActivationQuantizer(ActivationQuantConfig(bits=4, policy="budget"))
    old.load_state_dict({"version": 1, "plan": [4, 8]})  # version 1 did not record the policy
    assert old.plan is None


# ----------------------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kwargs,words,error",
    [
        ({"bits": 9}, ["ActivationQuantization(bits=9)", "1..8"], ValueError),
        ({"bits": 0}, ["ActivationQuantization(bits=0)", "1..8"], ValueError),
        ({"bits": 4.0}, ["ActivationQuantization(bits=4.0)", "an int"], TypeError),
        (
            {"policy": "greedy"},
            ["ActivationQuantization(policy='greedy')", "uniform", "layer_aware", "budget"],
            ValueError,
        ),
        ({"block_size": 0}, ["ActivationQuantization(block_size=0)", ">= 1"], ValueError),
        ({"min_numel": -1}, ["ActivationQuantization(min_numel=-1)"], ValueError),
        ({"edge_bits": 3}, ["ActivationQuantization(edge_bits=3)", "4..8"], ValueError),
        ({"budget_bits": 3.5}, ["ActivationQuantization(budget_bits=3.5)", "8"], ValueError),
        ({"budget_bits": 9.0}, ["ActivationQuantization(budget_bits=9.0)"], ValueError),
        ({"attention_patterns": 7}, ["ActivationQuantization(attention_patterns=7)"], TypeError),
        ({"calibration_steps": 0}, ["ActivationQuantization(calibration_steps=0)"], ValueError),
        ({"recompute": "yes"}, ["ActivationQuantization(recompute='yes')"], TypeError),
        ({"seed": -2}, ["ActivationQuantization(seed=-2)"], ValueError),
        ({"log_every_n_steps": 0}, ["ActivationQuantization(log_every_n_steps=0)"], ValueError),
        ({"grad_storage": "int8"}, ["ActivationQuantization(grad_storage='int8')", "fp32", "fp8_e4m3"], ValueError),
    ],
)
def test_bad_arguments_raise_naming_argument_value_and_allowed(kwargs, words, error):
    with pytest.raises(error) as err:
        ActivationQuantization(**kwargs)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_attention_patterns_are_a_lowercased_str():
    a = ActivationQuantization(attention_patterns="*Attn*, SelfAttention")
    assert a.config.attention_patterns == ("*attn*", "selfattention")
    assert ActivationQuantization(attention_patterns=None).config.attention_patterns == ()
    with pytest.raises(TypeError, match="attention_patterns"):
        ActivationQuantization(attention_patterns=["*attn*"])  # not a typed primitive
    # patterns given to the config directly are matched case-insensitively too
    cfg = ActivationQuantConfig(attention_patterns=("*ATTN*",))
    assert cfg.attention_patterns == ("*attn*",)
    net, idx = _net_and_data()
    _, q = _quantized_grads(net, idx, bits=4, attention_patterns=("*ATTN*",))
    inner = [r for r in q.records if r.module in ("attn.qkv", "attn.proj") and not r.parameter]
    assert len(inner) == 2 and all(r.reason == "attention" for r in inner)


# ----------------------------------------------------------------------------------------- Lightning


class TinyGPT(pl.LightningModule):
    """ByteGPT-like, on a fixed random token set (no files): logs train_loss, keeps the loss curve."""

    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        from lightning_qcomm.demo import ByteGPT

        self.gpt = ByteGPT(n_layer=2, n_head=2, n_embd=64, block_size=64)
        self.lr = lr
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.gpt(x).flatten(0, 1), y.flatten())
        self.losses.append(float(loss.detach()))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        # a learnable stream: token t+1 = (3 t + 1) mod 64 with 10% noise
        start = torch.randint(0, 64, (512, 1), generator=g)
        seq = (start * torch.pow(3, torch.arange(65)) + torch.arange(65)) % 64
        noise = torch.rand(seq.shape, generator=g) < 0.1
        seq = torch.where(noise, torch.randint(0, 64, seq.shape, generator=g), seq)
        ds = torch.utils.data.TensorDataset(seq[:, :-1], seq[:, 1:])
        return torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, generator=g)


class HookedGPT(TinyGPT):
    """TinyGPT with a validation loop and switches for the lifecycle tests: skip the rest of the epoch at
    ``skip_at`` (on_train_batch_start returns -1), raise at global step ``raise_at``, make the output gradient
    non-finite at global step ``inf_grad_step`` (non-finite gradients are zeroed before the optimizer step, as
    an fp16 GradScaler would skip the step); records whether any p.grad was None in its own on_after_backward."""

    def __init__(self, skip_at=None, raise_at=None, inf_grad_step=None) -> None:
        super().__init__()
        self.skip_at, self.raise_at, self.inf_grad_step = skip_at, raise_at, inf_grad_step
        self.grad_none_after_backward: list[bool] = []
        self.grads_after_backward: list[dict[str, torch.Tensor]] = []

    def on_train_batch_start(self, batch, batch_idx):
        return -1 if batch_idx == self.skip_at else None

    def training_step(self, batch, batch_idx):
        if self.global_step == self.raise_at:
            raise RuntimeError("boom")
        x, y = batch
        logits = self.gpt(x) * 1.0
        if self.global_step == self.inf_grad_step:
            logits.register_hook(lambda g: g * float("inf"))
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.losses.append(float(loss.detach()))
        return loss

    def on_after_backward(self):
        self.grad_none_after_backward.append(any(p.grad is None for p in self.parameters()))
        self.grads_after_backward.append({n: p.grad.clone() for n, p in self.named_parameters() if p.grad is not None})

    def on_before_optimizer_step(self, optimizer):
        for p in self.parameters():
            p.grad.nan_to_num_(0.0, 0.0, 0.0)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.gpt(x).flatten(0, 1), y.flatten())

    def val_dataloader(self):
        x = torch.randint(0, 64, (16, 64), generator=torch.Generator().manual_seed(1))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x), batch_size=8)


def _nothing_left_on_the_stacks() -> bool:
    from lightning_qcomm.memory.quantizer import _top_saved_tensors_hooks

    return torch._C._len_torch_function_stack() == 0 and _top_saved_tensors_hooks() is None


class _ValidationProbe(pl.Callback):
    """Validation forwards must not touch the quantizer: inactive, nothing on torch's function-mode or
    saved-tensor-hook stacks, records and stats unchanged from the last training forward."""

    def __init__(self, cb: ActivationQuantization) -> None:
        self.cb = cb
        self.checked = 0
        self.plan_at_train_start = "unset"
        self.first_forward_bits: list[int] | None = None

    def _snapshot(self):
        q = self.cb.quantizer
        return len(q.records), dataclasses.astuple(q.stats)

    def on_train_start(self, trainer, pl_module):
        self.plan_at_train_start = self.cb.quantizer.plan

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first_forward_bits is None:
            self.first_forward_bits = [r.bits for r in self.cb.quantizer.records if r.action == "quantized"]

    def on_validation_start(self, trainer, pl_module):
        self.before = self._snapshot()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        assert not self.cb.quantizer.active and _nothing_left_on_the_stacks()

    def on_validation_end(self, trainer, pl_module):
        assert self._snapshot() == self.before
        self.checked += 1


def _fit(model, callbacks, tmp_path=None, ckpt_path=None, **trainer_kwargs):
    kwargs = dict(
        accelerator="cpu",
        devices=1,
        callbacks=callbacks,
        logger=pl.loggers.CSVLogger(tmp_path) if tmp_path is not None else False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
    )
    kwargs.update(trainer_kwargs)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def test_single_device_trainer_logs_metrics_and_resumes_the_plan(tmp_path):
    torch.manual_seed(0)
    cb = ActivationQuantization(bits=4, policy="budget", budget_bits=5.0, log_every_n_steps=1, record_saves=True)
    probe = _ValidationProbe(cb)
    model = HookedGPT()
    trainer = _fit(model, [cb, probe], tmp_path, max_steps=4, accumulate_grad_batches=2, val_check_interval=1)
    assert probe.checked == 8  # validation after every training batch, never touching the quantizer
    assert cb.quantizer.plan is not None and not cb.quantizer.active and _nothing_left_on_the_stacks()
    m = cb.metrics()
    assert 0 < m["actq/ratio"] < 1 and m["actq/saved_bytes"] < m["actq/baseline_bytes"]
    assert m["actq/avg_bits"] == pytest.approx(
        average_bits([c.numel for c in cb.quantizer.calibration], cb.quantizer.plan)
    )
    header = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()[0]
    assert "actq/saved_bytes" in header and "actq/ratio" in header
    ckpt = tmp_path / "a.ckpt"
    trainer.save_checkpoint(ckpt)
    state = torch.load(ckpt, weights_only=False)["callbacks"]
    (saved,) = [v for k, v in state.items() if "ActivationQuantization" in k]
    assert saved["plan"] == cb.quantizer.plan and saved["policy"] == "budget"
    # resume: the plan is restored before the first forward (no new 8-bit calibration step)
    cb2 = ActivationQuantization(bits=4, policy="budget", budget_bits=5.0, record_saves=True)
    probe2 = _ValidationProbe(cb2)
    torch.manual_seed(0)
    _fit(HookedGPT(), [cb2, probe2], ckpt_path=ckpt, max_steps=5, accumulate_grad_batches=2, limit_val_batches=0)
    assert probe2.plan_at_train_start == saved["plan"] == cb2.quantizer.plan
    assert probe2.first_forward_bits == saved["plan"] and set(saved["plan"]) != {8}


def test_a_skipped_batch_end_does_not_leave_the_quantizer_open():
    """on_train_batch_start returning -1 makes Lightning skip on_train_batch_end: the forward opened by the
    callback's batch start must be closed at the epoch end / next batch start (it raised "begin() called twice")."""
    torch.manual_seed(0)
    cb = ActivationQuantization(bits=4)
    model = HookedGPT(skip_at=1)
    _fit(model, [cb], max_epochs=2, limit_train_batches=3, limit_val_batches=0)
    assert len(model.losses) == 2 and not cb.quantizer.active and _nothing_left_on_the_stacks()


def test_an_exception_during_the_forward_leaves_nothing_behind():
    torch.manual_seed(0)
    cb = ActivationQuantization(bits=4)
    with pytest.raises(RuntimeError, match="boom"):
        _fit(HookedGPT(raise_at=1), [cb], max_steps=3, limit_val_batches=0)
    assert not cb.quantizer.active and _nothing_left_on_the_stacks()


def test_budget_calibration_step_with_non_finite_gradients_is_rejected(caplog):
    torch.manual_seed(0)
    cb = ActivationQuantization(bits=4, policy="budget", budget_bits=5.0)
    with caplog.at_level("WARNING"):
        _fit(HookedGPT(inf_grad_step=0), [cb], max_steps=3, limit_val_batches=0)
    assert "calibration step 0 rejected" in caplog.text
    assert cb._calibration_start == 1 and cb.quantizer.plan is not None and len(set(cb.quantizer.plan)) > 1
    assert all(math.isfinite(c.coef) for c in cb.quantizer.calibration)


class TwoOptimizerGPT(TinyGPT):
    """Manual optimization, two optimizers, two losses through one retained graph, then a second forward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt_blocks, opt_rest = self.optimizers()
        x, y = batch
        logits = self.gpt(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(1e-3 * logits.square().mean())
        opt_blocks.step()
        opt_blocks.zero_grad()
        loss2 = F.cross_entropy(self.gpt(x).flatten(0, 1), y.flatten())
        self.manual_backward(loss2)
        opt_rest.step()
        opt_rest.zero_grad()
        self.losses += [float(loss.detach()), float(loss2.detach())]

    def configure_optimizers(self):
        blocks = list(self.gpt.blocks.parameters())
        ids = {id(p) for p in blocks}
        rest = [p for p in self.parameters() if id(p) not in ids]
        return torch.optim.AdamW(blocks, lr=self.lr), torch.optim.AdamW(rest, lr=self.lr)


def test_manual_optimization_two_optimizers_and_retain_graph():
    torch.manual_seed(0)
    cb = ActivationQuantization(bits=4, record_saves=True)
    model = TwoOptimizerGPT()
    with _QuantizedStorages(model.parameters) as guard:
        trainer = _fit(model, [cb], max_steps=4, limit_val_batches=0)
    assert trainer.global_step == 4 and len(model.losses) == 4 and all(math.isfinite(v) for v in model.losses)
    assert guard.quantized > 0 and guard.weights == 0
    assert not cb.quantizer.active and _nothing_left_on_the_stacks()


class _GradRecorder(pl.Callback):
    """Copies every p.grad right after each backward (runs before ActivationQuantization's hooks) and at the step."""

    def __init__(self):
        self.after_backward: list[dict[str, torch.Tensor]] = []
        self.at_step: dict[str, torch.Tensor] = {}

    def on_after_backward(self, trainer, pl_module):
        self.after_backward.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not self.at_step:
            self.at_step = {n: p.grad.clone() for n, p in pl_module.named_parameters()}


def _accumulate_once(grad_storage: str):
    torch.manual_seed(0)
    model = HookedGPT()
    rec = _GradRecorder()
    cb = ActivationQuantization(bits=4, grad_storage=grad_storage, min_numel=1024)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        accumulate_grad_batches=3,
        callbacks=[rec, cb],
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(model)
    return rec, cb, model


def test_fp8_gradient_storage_between_micro_batches_within_fp8_bound():
    """Same init, batches and activation codes, so the micro-batch gradients g_k are identical in both runs.
    FP8 run: after backward k < 3 the recorder sees a_k (a_1 = g_1, a_2 = D(Q(a_1)) + g_2), then the callback
    stores Q(a_k); the step sees D(Q(a_2)) + g_3. So |step_fp8 - step_fp32| <= e(a_1) + e(a_2) with the e4m3
    round-to-nearest bound e(v) = 2^-4 · max(|v|, s · 2^-6), s = block amax / 448 (codecs.fp8)."""
    rec32, _, _ = _accumulate_once("fp32")
    rec8, cb8, model8 = _accumulate_once("fp8_e4m3")
    assert len(rec8.after_backward) == 3
    # the LightningModule's own on_after_backward (after every callback's) still sees the gradients
    assert model8.grad_none_after_backward == [False, False, False]
    for seen, recorded in zip(model8.grads_after_backward, rec8.after_backward):
        assert all(torch.equal(seen[n], recorded[n]) for n in recorded)
    stored, baseline = cb8.grad_bytes
    assert 0 < stored < 0.27 * baseline  # 1 byte + 4/128 per fp32 element
    checked = 0
    for name, g32 in rec32.at_step.items():
        g8 = rec8.at_step[name]
        if g32.numel() < 1024:  # not stored: exact
            assert torch.equal(g8, g32), name
            continue
        bound = torch.zeros(g32.numel(), dtype=torch.float64)
        for a in (rec8.after_backward[0][name], rec8.after_backward[1][name]):
            v = a.reshape(-1).double()
            pad = (-v.numel()) % 128
            amax = torch.nn.functional.pad(v.abs(), (0, pad)).view(-1, 128).amax(dim=1)
            s = (amax / 448.0).repeat_interleave(128)[: v.numel()]
            bound += 2.0**-4 * torch.maximum(v.abs(), s * 2.0**-6)
        diff = (g8.reshape(-1).double() - g32.reshape(-1).double()).abs()
        assert torch.all(diff <= bound * (1 + 1e-5) + 1e-9), name
        checked += 1
        assert diff.max() > 0 or bound.max() == 0
    assert checked >= 8
    # the first micro-batch saw identical parameters and codes in both runs
    assert all(torch.equal(rec8.after_backward[0][n], rec32.after_backward[0][n]) for n in rec32.at_step)


def test_cli_config_trains(tmp_path, monkeypatch):
    from lightning_qcomm.cli import make_cli

    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    monkeypatch.chdir(tmp_path)
    cli = make_cli(
        [
            "fit",
            "--config",
            str(REPO / "configs" / "activation_quant.yaml"),
            "--trainer.devices=1",
            "--trainer.strategy=auto",
            "--trainer.max_steps=3",
            "--trainer.val_check_interval=3",
            "--trainer.limit_val_batches=1",
            "--trainer.log_every_n_steps=1",
            "--trainer.enable_progress_bar=false",
            "--model.n_layer=1",
            "--model.n_head=2",
            "--model.n_embd=32",
            "--model.block_size=32",
            "--data.block_size=32",
            "--data.batch_size=4",
            "--data.max_bytes=40000",
            f"--trainer.logger.init_args.save_dir={tmp_path}",
        ]
    )
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, ActivationQuantization)]
    assert cb.config.bits == 4 and cb.config.policy == "layer_aware" and cb.config.block_size == 128
    assert cli.trainer.global_step == 3 and cb.quantizer.plan is not None
    assert cb.last_step_stats.quantized_tensors > 0
    header = next(tmp_path.rglob("metrics.csv")).read_text().splitlines()[0]
    assert "actq/ratio" in header


# ----------------------------------------------------------------------------------------- 2 ranks


STEPS = 40


def _worker(rank: int, port: int, outdir: str) -> None:
    import warnings

    from lightning_qcomm.strategies.qsdp import QSDPStrategy

    warnings.filterwarnings("ignore")
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    res = {}

    def fit(name, strategy, cb=None, steps=STEPS, accumulate=1):
        torch.manual_seed(0)
        model = TinyGPT()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy,
            max_steps=steps,
            accumulate_grad_batches=accumulate,
            callbacks=[cb] if cb else [],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        with _QuantizedStorages(model.parameters) as guard:
            trainer.fit(model)
        out = {"losses": model.losses, "param_sum": float(sum(p.double().sum() for p in model.parameters()))}
        if cb is not None:
            out["metrics"] = cb.metrics()
            out["plan"] = cb.quantizer.plan
            recs = cb.quantizer.records
            # parameter-ness decided from storages by the test (0 expected), and the quantizer's own view: one
            # kept weight per Linear call of the forward (a missed FSDP2 weight view would show up as "not the
            # op input" or quantized instead)
            out["weights_quantized"], out["quantized_calls"] = guard.weights, guard.quantized
            out["linear_weights_kept"] = sum(r.parameter and r.op == "linear" and r.action == "kept" for r in recs)
            out["linear_modules"] = sum(isinstance(m, nn.Linear) for m in model.modules())
            out["ops_quantized"] = sorted({r.op for r in recs if r.action == "quantized"})
            sdpa = [r for r in recs if r.op == "scaled_dot_product_attention"]
            out["attention_kept"] = bool(sdpa) and all(r.action == "kept" and r.reason == "attention" for r in sdpa)
        res[name] = out

    fit("ddp", "ddp")
    fit("ddp_actq4", "ddp", ActivationQuantization(bits=4, record_saves=True))
    fit("ddp_budget", "ddp", ActivationQuantization(bits=4, policy="budget", budget_bits=5.0), steps=6)
    fit("qsdp_actq4", QSDPStrategy(bits=8), ActivationQuantization(bits=4, record_saves=True), steps=6)
    fit("ddp_acc2", "ddp", ActivationQuantization(bits=4), steps=6, accumulate=2)
    fit("ddp_acc2_fp8", "ddp", ActivationQuantization(bits=4, grad_storage="fp8_e4m3"), steps=6, accumulate=2)
    write_rank_result(outdir, rank, res)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("actq2")
    os.environ["OMP_NUM_THREADS"] = "1"
    spawn(_worker, free_port(), str(out), nprocs=2)
    return rank_results(out, 2)


def _tail(losses, k=8):
    return sum(losses[-k:]) / k


@pytest.mark.slow
def test_ddp_trains_with_activation_quantization(two_ranks):
    """Band: the mean of the last 8 step losses with 4-bit activations is within 0.05 nats of plain DDP's
    (the gradient noise of 4-bit saves is a few % of the gradient, far below the loss drop of ~1.5 nats)."""
    for r in two_ranks:
        base, q = r["ddp"]["losses"], r["ddp_actq4"]["losses"]
        assert len(q) == STEPS
        assert _tail(q) < q[0] - 1.0, "loss did not decrease"
        assert abs(_tail(q) - _tail(base)) <= 0.05, (_tail(q), _tail(base))
        m = r["ddp_actq4"]["metrics"]
        assert m["actq/ratio"] < 0.7 and m["actq/quantized_ratio"] == pytest.approx(4 / 32 + 64 / (32 * 128))
        q = r["ddp_actq4"]
        assert q["weights_quantized"] == 0 and q["quantized_calls"] > 0
        assert q["linear_weights_kept"] == q["linear_modules"] == 9  # 2 blocks x (qkv, proj, fc, proj) + head
        assert r["ddp_actq4"]["attention_kept"]
        assert r["ddp_actq4"]["ops_quantized"] == ["gelu", "layer_norm", "linear"]


@pytest.mark.slow
def test_budget_plan_is_identical_on_every_rank(two_ranks):
    plans = [r["ddp_budget"]["plan"] for r in two_ranks]
    assert plans[0] is not None and plans[0] == plans[1]
    assert set(plans[0]) <= {4, 5, 6, 8} and len(set(plans[0])) > 1
    assert all(r["ddp_budget"]["metrics"]["actq/avg_bits"] <= 5.0 for r in two_ranks)


@pytest.mark.slow
def test_qsdp_fsdp2_with_activation_quantization(two_ranks):
    """Under FSDP2 the saved weights are views of the unsharded parameters: seen, never quantized."""
    for r in two_ranks:
        q = r["qsdp_actq4"]
        assert len(q["losses"]) == 6 and all(math.isfinite(v) for v in q["losses"])
        assert q["weights_quantized"] == 0 and q["quantized_calls"] > 0
        assert q["linear_weights_kept"] == q["linear_modules"] == 9
        assert q["ops_quantized"] == ["gelu", "layer_norm", "linear"] and q["attention_kept"]
        assert q["metrics"]["actq/ratio"] < 0.7


@pytest.mark.slow
def test_ddp_gradient_accumulation_with_fp8_gradient_storage(two_ranks):
    """DDP reduces the restored fp32 accumulation in the last backward: ranks stay identical, the loss curve
    follows the fp32-storage run (the first window's losses are identical: same parameters and codes)."""
    a, b = two_ranks
    assert a["ddp_acc2_fp8"]["param_sum"] == b["ddp_acc2_fp8"]["param_sum"]
    l8, l32 = a["ddp_acc2_fp8"]["losses"], a["ddp_acc2"]["losses"]
    assert len(l8) == len(l32) == 12 and l8[:2] == l32[:2]
    assert all(math.isfinite(v) for v in l8) and max(abs(x - y) for x, y in zip(l8, l32)) < 0.05
    m = a["ddp_acc2_fp8"]["metrics"]
    assert 0 < m["actq/grad_stored_bytes"] < 0.27 * m["actq/grad_baseline_bytes"]


@pytest.mark.parametrize("scale", [1.0, 1e-40, 1e38], ids=["ordinary", "subnormal", "near_flt_max"])
def test_rounding_variance_sum_reads_the_blocks_own_range(scale):
    """The budget policy's V_l = sum over blocks of count * range^2 / 6 from the uniform codec's wire scales;
    blocks at the ends of fp32's range travel pre-scaled (a flagged unit), and must be read back in their own
    units. Reference: the fp64 range of each block, to fp32 rounding of the unit (relative 2^-20 with margin)."""
    from lightning_qcomm.memory import bit_allocation

    torch.set_flush_denormal(False)  # keep the subnormal case subnormal (the suite flushes them)
    try:
        # uniform in (-3, 3) * scale: at 1e38 every block's hi - lo overflows fp32, at 1e-40 every unit is subnormal
        x = (
            (torch.rand(1024, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 6 - 3) * scale
        ).float()
        packed = get_codec("uniform", 4, 256).encode(x, seed=0)
        assert scale == 1.0 or bool((packed.scales[:, 1] < 0).all()), "the extreme blocks were not pre-scaled"
    finally:
        torch.set_flush_denormal(True)
    torch.set_flush_denormal(False)
    try:
        blocks = x.double().view(-1, 256)
        expect = float(((blocks.amax(1) - blocks.amin(1)) ** 2 * 256 / 6).sum())
        got = bit_allocation.rounding_variance_sum(packed.scales, 4, x.numel(), 256)
    finally:
        torch.set_flush_denormal(True)
    assert expect > 0 and got == pytest.approx(expect, rel=2**-20, abs=0)
