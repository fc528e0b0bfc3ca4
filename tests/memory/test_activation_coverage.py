"""Activation quantization decides by op: what it covers on models nobody here wrote, and what that buys.

* Coverage: on GPT-2-, LLaMA- and BERT-shaped Hugging Face models (built from their configs, small sizes; SDPA
  and eager attention) and on Lightning's demo Transformer, at least 80% of the bytes the forward saves outside
  attention and losses are quantized (``SavedBytes.coverage``), while attention's own saves stay exact.
* Peak memory: one training step's peak above its start, from the CPU allocator's events
  (``benchmarks/peak_memory.py``), with 4-bit activations at most 0.75x (LLaMA shape) and 0.85x (GPT-2
  shape) of the fp32 step's. Activation bytes dominate these shapes (vocabulary 512); on a 32k vocabulary
  the logits and the loss, which stay exact, weigh more (BENCHMARKS.md §7).
* Gradients of element-wise ops through quantized saves stay within the codec's bound: for y = a · b,
  |∂a - g·b| <= |g|·unit_b element-wise (|b̃ - b| < unit_b, the block's step); for y = tanh(x) (which saves y),
  |∂x - g(1 - y²)| <= |g|·unit·(2|y| + unit).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_qcomm.codecs import get_codec
from lightning_qcomm.memory import ActivationQuantConfig, ActivationQuantizer
from lightning_qcomm.memory.op_rules import op_name, rule_for
from lightning_qcomm.memory.saved_tensors import SharedSaves

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from peak_memory import peak_bytes  # noqa: E402

VOCAB = 512


def _hf(name: str, attn: str, d: int = 64, layers: int = 2):
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=d, n_layer=layers, n_head=4)
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=d,
            intermediate_size=d * 8 // 3,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.BertConfig(
            vocab_size=VOCAB, hidden_size=d, num_hidden_layers=layers, num_attention_heads=4, intermediate_size=4 * d
        )
        model = transformers.BertForMaskedLM(cfg)
    model.config._attn_implementation = attn
    return model.train()


def _forward_stats(model, x, **cfg):
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, **cfg))
    q.attach(model)
    q.record = True
    with q.forward_context():
        out = model(x)
    q.detach()
    return q, out


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hugging_face_models_are_covered_without_configuration(name, attn):
    model = _hf(name, attn)
    x = torch.randint(0, VOCAB, (2, 64))
    q, _ = _forward_stats(model, x)
    s = q.stats
    assert s.coverage >= 0.8, (s.coverage, s.quantized_baseline, s.baseline, s.exact_by_rule)
    kinds = {r.reason for r in q.records if r.action == "quantized"}
    assert {"linear", "elementwise"} <= kinds or {"linear", "gelu"} <= kinds
    # attention stays exact: SDPA's saves, or (eager) the softmax and the two matmuls of activations
    attention = [r for r in q.records if r.reason == "attention"]
    assert attention and all(r.action == "kept" for r in attention)
    ops = {r.op for r in attention}
    assert ops == {"scaled_dot_product_attention"} if attn == "sdpa" else {"matmul", "softmax"} <= ops
    assert not [r for r in q.records if r.action == "quantized" and r.op in ("softmax", "scaled_dot_product_attention")]


def test_lightning_demo_transformer_is_covered():
    from lightning.pytorch.demos import Transformer

    torch.manual_seed(0)
    model = Transformer(vocab_size=VOCAB, ninp=64, nhead=4, nhid=128, nlayers=2).train()
    x = torch.randint(0, VOCAB, (2, 64))
    q = ActivationQuantizer(ActivationQuantConfig(bits=4))
    q.attach(model)
    with q.forward_context():
        model(x, x)
    q.detach()
    assert q.stats.coverage >= 0.8, q.stats


def _step_peak(model, x, quantizer):
    def step():
        model.zero_grad(set_to_none=False)
        if quantizer is None:
            logits = model(x).logits
        else:
            with quantizer.forward_context():
                logits = model(x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
        del logits
        loss.backward()
        return float(loss.detach())

    step()  # the gradients exist before the measured step, in both settings
    peak, _ = peak_bytes(step)
    return peak


@pytest.mark.parametrize(("name", "bound"), [("llama", 0.75), ("gpt2", 0.85)])
def test_peak_memory_of_a_training_step_falls(name, bound):
    model = _hf(name, "sdpa", d=128)
    x = torch.randint(0, VOCAB, (2, 256))
    base = _step_peak(model, x, None)
    q = ActivationQuantizer(ActivationQuantConfig(bits=4))
    q.attach(model)
    quant = _step_peak(model, x, q)
    q.detach()
    assert quant <= bound * base, (quant / base, quant, base)


def test_elementwise_gradients_within_the_codec_bound():
    torch.manual_seed(0)
    a0, b0, x0 = (torch.randn(8, 256) for _ in range(3))
    g = torch.randn(8, 256)
    codec = get_codec("uniform", bits=4, bucket_size=128)

    def unit(t):  # the step of each element's block (blocks of 128 along the flattened tensor)
        return codec.encode(t).scales[:, 1].repeat_interleave(128).view(t.shape)

    for seed in range(8):
        a, b, x = (t.clone().requires_grad_(True) for t in (a0, b0, x0))
        with ActivationQuantizer(
            ActivationQuantConfig(bits=4, block_size=128, min_numel=1, seed=seed)
        ).forward_context():
            a1, b1, x1 = a * 1.0, b * 1.0, x * 1.0  # intermediates (leaves are never quantized)
            y = a1 * b1
            t = torch.tanh(x1)
        torch.autograd.backward([y, t], [g, g])
        assert torch.all((a.grad - g * b0).abs() <= g.abs() * unit(b0) * (1 + 1e-5) + 1e-6)
        assert torch.all((b.grad - g * a0).abs() <= g.abs() * unit(a0) * (1 + 1e-5) + 1e-6)
        y0 = torch.tanh(x0)
        u = unit(y0)
        assert torch.all((x.grad - g * (1 - y0.square())).abs() <= g.abs() * u * (2 * y0.abs() + u) * (1 + 1e-5) + 1e-6)
        assert not torch.equal(a.grad, g * b0)  # the saves really were quantized


def test_a_tensor_saved_by_several_ops_is_stored_once():
    torch.manual_seed(0)
    x0 = torch.randn(64, 128, requires_grad=True)
    w1, w2 = (torch.nn.Parameter(torch.randn(128, 128)) for _ in range(2))
    q = ActivationQuantizer(ActivationQuantConfig(bits=4))
    q.record = True
    with q.forward_context():
        h = x0 * 2.0
        out = F.linear(h, w1) + F.linear(h, w2) + h.pow(2)  # h saved by three ops
    assert q.stats.quantized_tensors == 1
    shared = [r for r in q.records if r.reason == "shared"]
    assert len(shared) == 2 and {r.site for r in shared} == {0}
    out.sum().backward()
    assert torch.all(x0.grad.isfinite())


def test_shared_saves_never_match_a_freed_or_rewritten_tensor():
    cache = SharedSaves()
    t = torch.randn(4, 4)
    cache.put(t, "stored")
    assert cache.get(t) == "stored" and cache.get(t.view(16)) is None
    t.add_(1.0)  # a new version: not the saved values any more
    assert cache.get(t) is None
    u = torch.randn(4, 4)
    cache.put(u, "u")
    ptr = u.data_ptr()
    del u
    v = torch.empty(4, 4)  # may reuse u's memory: it must not match
    assert v.data_ptr() != ptr or cache.get(v) is None


@pytest.mark.parametrize(
    ("func", "expected"),
    [
        (torch.Tensor.__rmul__, "mul"),
        (torch.Tensor.__imul__, "mul"),
        (torch.Tensor.mul_, "mul"),
        (torch.Tensor.__matmul__, "matmul"),
        (F.linear, "linear"),
        (torch.relu, "relu"),
        (torch.Tensor.__radd__, "add"),
    ],
)
def test_op_names(func, expected):
    assert op_name(func) == expected


def test_rules_by_op():
    w = torch.nn.Parameter(torch.randn(8, 8))
    a, b = (torch.randn(8, 8, requires_grad=True) * 1.0 for _ in range(2))
    assert rule_for(torch.matmul, (a, w), {}).kind == "matmul"
    assert rule_for(torch.matmul, (a, w), {}).x is a
    assert rule_for(torch.matmul, (a, b), {}).exact == "attention"  # Q·Kᵀ written by hand
    assert rule_for(torch.addmm, (w[0], a, w), {}).x is a  # GPT-2's Conv1D
    assert rule_for(F.cross_entropy, (a, torch.zeros(8, dtype=torch.long)), {}).exact == "loss"
    assert rule_for(F.scaled_dot_product_attention, (a, a, a), {}).exact == "attention"
    assert rule_for(torch.Tensor.__mul__, (a, b), {}).kind == "elementwise"
    assert rule_for(torch.cumprod, (a, 0), {}) is None
