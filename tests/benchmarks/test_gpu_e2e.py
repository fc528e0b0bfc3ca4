"""benchmarks/gpu_e2e.py at its tiny size on CPU: every (model, method) it runs trains in a process of its own and
reports a step time, its ratio to the baseline row, and the ops per step; the LLaMA-style model builds and trains
too. No timing is asserted."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import gpu_e2e  # noqa: E402

METHODS = ["ddp", "qddp_nuqsgd4", "fsdp2", "qsdp_w8g8", "onebit_adam", "actq4"]


def test_gpu_e2e_tiny_runs_every_method_it_is_given(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "e2e"
    args = ["--size", "tiny", "--models", "gpt2", "--methods", ",".join(METHODS), "--warmup", "3", "--steps", "2"]
    rows = gpu_e2e.main([*args, "--budget-s", "600", "--out", str(out)])
    assert [r["method"] for r in rows] == METHODS
    for r in rows:
        assert "error" not in r, r
        assert r["step_ms"] > 0 and r["launches_per_step"] > 0 and math.isfinite(r["loss"]), r
    text = out.with_suffix(".md").read_text()
    assert "| gpt2 | qsdp_w8g8 |" in text and "| fsdp2 |" in text.split("| gpt2 | qsdp_w8g8 |")[1].split("\n")[0]
    ddp = next(r for r in rows if r["method"] == "ddp")
    quant = next(r for r in rows if r["method"] == "qddp_nuqsgd4")
    assert quant["launches_per_step"] > ddp["launches_per_step"]  # the codec work is counted, not only DDP's


def test_llama_shape_builds_and_trains_one_step():
    import torch

    model = gpu_e2e.build_model("llama", "tiny")
    ids = torch.randint(0, gpu_e2e.SIZES["tiny"]["vocab"]["llama"], (2, 16))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(float(loss)) and type(model).__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="allowed: gpt2, llama"):
        gpu_e2e.build_model("bert", "tiny")
