"""Saved activations encoded a layer at a time (``memory/save_batch.py``, ``ActivationQuantConfig.batch_saves``).

Under Triton's interpreter (a fresh process, ``tests/_helpers/_interpreted.py``), on the CUDA path: a GPT-2 forward and
backward with the saves batched gives the loss and gradients of the same step with each save encoded alone, bit
for bit, in one encode (two launches) and one decode per layer, with no save left pending when a block's forward
ends; a restore after the batch's buffer is gone decodes again, and a save's strides come back; and a DDP step
with 4-bit ActivationQuantization launches at most 1.15x plain DDP's. On CPU the saves are encoded at once
(no batch), and the option is checked like every other.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_qcomm.callbacks import ActivationQuantization
from lightning_qcomm.memory import ActivationQuantConfig, ActivationQuantizer
from lightning_qcomm.memory.save_batch import BatchedActivation
from lightning_qcomm.memory.saved_tensors import QuantizedActivation

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_option_is_checked():
    with pytest.raises(TypeError, match=r"ActivationQuantConfig\(batch_saves="):
        ActivationQuantConfig(batch_saves="yes")
    with pytest.raises(TypeError, match=r"ActivationQuantization\(batch_saves="):
        ActivationQuantization(batch_saves=1)
    assert ActivationQuantization(batch_saves=False).config.batch_saves is False


def test_cpu_saves_are_encoded_at_once():
    """On CPU a batch gives no launch back: every save is stored encoded when it is made."""
    layers = torch.nn.ModuleList([torch.nn.Linear(64, 64) for _ in range(2)])
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=16))
    q.attach(layers)
    x = torch.randn(32, 64, requires_grad=True)
    with q.forward_context():
        y = layers[1](layers[0](x * 1.0) * 2.0)
        stored = [v[1][2] for v in q._shared._entries.values() if v[1][0] is not None]  # cleared by end()
    assert len(stored) == 2 and all(isinstance(s, QuantizedActivation) for s in stored)
    y.sum().backward()


# ---------------------------------------------------------------------------------------------- interpreted
def _gpt2_step(batch: bool, log: list[str]) -> dict:
    import step_launches as sl

    model = sl.gpt2(0.02)
    tokens = torch.randint(0, model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=64, batch_saves=batch))
    q.attach(model)
    pending_at_block_end = []
    for block in model.transformer.h:  # registered after the quantizer's hooks: runs after its flush
        block.register_forward_hook(lambda *a: pending_at_block_end.append(len(q._pending)))
    log.clear()
    with q.forward_context(step=1):
        loss = model(tokens, labels=tokens).loss
    encodes = list(log)
    log.clear()
    loss.backward()
    return {
        "loss": loss.detach(),
        "grads": [p.grad.clone() for p in model.parameters()],
        "encode_log": encodes,
        "decode_log": list(log),
        "pending": pending_at_block_end,
        "sites": q.stats.quantized_tensors,
        "stored": q.stats.stored,
    }


def _guarded_step():
    """Forward and backward of two blocks with their saves batched, under the host-sync guard (after a first step,
    which uploads the layout's table): True, or the guard's refusal."""
    import torch.nn.functional as F
    from _sync_guard import NoHostSync

    blocks = torch.nn.ModuleList(
        [torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)) for _ in range(2)]
    )
    q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=16))
    q.attach(blocks)
    x = torch.randn(32, 64, requires_grad=True)

    def step():
        with q.forward_context(step=1):
            h = x * 1.0
            for block in blocks:
                h = h + block[1](F.gelu(block[0](F.layer_norm(h, (64,)))))
        h.sum().backward()

    step()
    try:
        with NoHostSync():
            step()
    except AssertionError as e:
        return repr(e)[:300]
    return True


def _worker() -> dict:
    import step_launches as sl
    from launch_counts import cuda_path_on_cpu, mirrored_collectives

    from lightning_qcomm.codecs import get_codec

    out = {}
    with cuda_path_on_cpu() as log:
        get_codec("uniform", 4, 128).encode(torch.randn(256), seed=0)  # the codec's first-use check, before counting
        alone, batched = _gpt2_step(False, log), _gpt2_step(True, log)
        out["same_loss"] = torch.equal(alone["loss"], batched["loss"])
        out["same_grads"] = all(torch.equal(a, b) for a, b in zip(alone["grads"], batched["grads"]))
        out["same_bytes"] = alone["stored"] == batched["stored"] and alone["sites"] == batched["sites"] > 12
        out["alone_launches"] = alone["encode_log"].count("encode") == alone["sites"]
        # 12 blocks and what follows the last one (the final norm), each one encode and one decode
        out["batched_encodes"] = batched["encode_log"] == ["wire", "encode"] * 13
        out["batched_decodes"] = batched["decode_log"] == ["decode"] * 13
        out["nothing_pending_at_block_end"] = batched["pending"] == [0] * 12

        layers = torch.nn.ModuleList([torch.nn.Linear(64, 64), torch.nn.Linear(32, 64)])
        q = ActivationQuantizer(ActivationQuantConfig(bits=4, min_numel=16))
        q.attach(layers)
        x = torch.randn(32, 64, requires_grad=True)
        with q.forward_context():
            h = layers[0](x * 2.0)  # saves its contiguous input
            z = x.t() * 3.0  # (64, 32) of strides (1, 64)
            h = (layers[1](z), h)  # saves it as it is
            saved = [v[1][2] for v in q._shared._entries.values() if isinstance(v[1][2], BatchedActivation)]
        dense, strided = sorted(saved, key=lambda s: s.stride != (64, 1))
        assert strided.stride == (1, 64), [s.stride for s in saved]
        log.clear()
        first = dense.restore()
        again = dense.restore()  # the first view still lives: one decode
        out["view_reused"] = log == ["decode"] and torch.equal(first, again)
        del first, again
        log.clear()
        later = dense.restore()  # restored once already and no view left: decoded again
        out["decoded_again"] = log == ["decode"]
        back = strided.restore()
        unit = float(z.max() - z.min()) / 15  # 4 bits: |restore - x| < the block's unit <= the whole range / 15
        out["strides_back"] = back.stride() == (1, 64) and float((back - z.detach()).abs().max()) < unit
        del h, later

        out["sync_free"] = _guarded_step()

    with cuda_path_on_cpu() as log, mirrored_collectives():
        base = sl.count_step("ddp", 0.0625, 2, log)
        actq = sl.count_step("actq-4", 0.0625, 2, log)
    out["step_ratio"] = actq["total"] / base["total"]
    out["step_counts"] = [base["total"], actq["total"], actq["triton"]]
    return out


@pytest.fixture(scope="module")
def report() -> dict:
    pytest.importorskip("triton")
    pytest.importorskip("transformers")
    from _interpreted import run_interpreted

    return run_interpreted(__file__, 1200)


@pytest.mark.parametrize("case", ["same_loss", "same_grads", "same_bytes", "alone_launches"])
def test_batched_saves_give_the_step_of_saves_alone(report, case):
    assert report[case]


@pytest.mark.parametrize("case", ["batched_encodes", "batched_decodes", "nothing_pending_at_block_end"])
def test_one_encode_and_one_decode_per_layer(report, case):
    assert report[case]


def test_batched_saves_wait_for_nothing(report):
    assert report["sync_free"] is True, report["sync_free"]


@pytest.mark.parametrize("case", ["view_reused", "decoded_again", "strides_back"])
def test_the_decoded_batch_lives_while_it_is_used(report, case):
    assert report[case]


def test_activation_quantization_step_launches_within_ddps(report):
    """A DDP step with 4-bit ActivationQuantization within 1.15x DDP's launches (each save alone: 1.29x)."""
    assert report["step_ratio"] <= 1.15, report["step_counts"]


if __name__ == "__main__":
    sys.path[:0] = [str(BENCHMARKS), str(Path(__file__).resolve().parents[1] / "_helpers")]
    print(json.dumps(_worker()))
