"""LightningCLI entry point and configs/: every YAML parses and trains (2 CPU ranks), strategy name forms, quickstart.

* Every ``configs/*.yaml`` is instantiated in-process (parse + class resolution) and then trained for a few steps
  with a tiny model, all configs in one two-rank spawn (the workers set ``LOCAL_RANK`` so Lightning uses them
  as its ranks instead of launching its own). A config whose strategy or callback module does not exist yet is
  skipped with the reason, so it starts running when that module lands.
* ``trainer.strategy`` as a registered string, as a full ``class_path`` and as a short class name.
* The README quickstart command, reduced to a few steps, run as a real subprocess: prints the summary table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from lightning_qcomm.callbacks import CommVolumeLogger
from lightning_qcomm.cli import make_cli

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
MAX_STEPS = 4

# names a config may use -> the module that must exist for it (strategies/callbacks written under other issues)
REQUIRES = {
    "qsdp": "lightning_qcomm.strategies.qsdp",
    "qsdp_w8g8": "lightning_qcomm.strategies.qsdp",
    "qsdp_w4g4": "lightning_qcomm.strategies.qsdp",
    "QSDPStrategy": "lightning_qcomm.strategies.qsdp",
    "quant_ddp": "lightning_qcomm.strategies.quant_ddp",
    "QuantDDPStrategy": "lightning_qcomm.strategies.quant_ddp",
    "local_sgd": "lightning_qcomm.strategies.local_sgd",
    "local_sgd_qsr": "lightning_qcomm.strategies.local_sgd",
    "LocalSGDStrategy": "lightning_qcomm.strategies.local_sgd",
    "OneBitAdamCallback": "lightning_qcomm.callbacks.onebit_adam",
    "ActivationQuantization": "lightning_qcomm.callbacks.activation_quant",
}
STRATEGY_FORMS = [  # (registered name, class name, module)
    ("quant_ddp", "QuantDDPStrategy", "lightning_qcomm.strategies.quant_ddp"),
    ("qsdp", "QSDPStrategy", "lightning_qcomm.strategies.qsdp"),
    ("local_sgd_qsr", "LocalSGDStrategy", "lightning_qcomm.strategies.local_sgd"),
    ("ddp", "DDPStrategy", "lightning.pytorch.strategies.ddp"),
]
TINY = [  # a model small enough that every config trains MAX_STEPS steps in about a second
    f"--trainer.max_steps={MAX_STEPS}",
    f"--trainer.val_check_interval={MAX_STEPS}",
    "--trainer.limit_val_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--model.n_layer=1",
    "--model.n_head=2",
    "--model.n_embd=32",
    "--model.block_size=32",
    "--model.warmup_steps=2",
    "--data.block_size=32",
    "--data.batch_size=4",
    "--data.max_bytes=40000",
]


def _names_used(cfg: dict) -> list[str]:
    """Strategy and callback names in a parsed YAML (string names and the last part of class paths)."""
    trainer = cfg.get("trainer", {})
    items = [trainer.get("strategy")] + list(trainer.get("callbacks") or [])
    names = []
    for item in items:
        if isinstance(item, str):
            names.append(item)
        elif isinstance(item, dict) and "class_path" in item:
            names.append(item["class_path"].rsplit(".", 1)[-1])
    return names


def missing_module(path: Path) -> str | None:
    """The first module the config needs that does not exist yet, else None."""
    for name in _names_used(yaml.safe_load(path.read_text())):
        module = REQUIRES.get(name)
        if module and importlib.util.find_spec(module) is None:
            return module
    return None


def _skip_if_missing(path: Path) -> None:
    module = missing_module(path)
    if module:
        pytest.skip(f"{path.name} needs {module}, which does not exist yet")


def _comm_logger(trainer) -> CommVolumeLogger:
    found = [cb for cb in trainer.callbacks if isinstance(cb, CommVolumeLogger)]
    assert found, "config has no CommVolumeLogger"
    return found[0]


# --------------------------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_parses_and_instantiates(path, tmp_path, monkeypatch):
    _skip_if_missing(path)
    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])  # args come from the list, not pytest's argv
    cli = make_cli(["--config", str(path), f"--trainer.logger.init_args.save_dir={tmp_path}"], run=False)
    assert cli.trainer.num_devices == 2 and cli.trainer.accelerator.__class__.__name__ == "CPUAccelerator"
    _comm_logger(cli.trainer)
    declared = yaml.safe_load(path.read_text())["trainer"]["strategy"]
    name = declared if isinstance(declared, str) else declared["class_path"].rsplit(".", 1)[-1]
    module = REQUIRES.get(name)
    if module:  # the configured class (or the class the registered name stands for) was built
        assert type(cli.trainer.strategy).__module__ == module, f"{path.name}: got {type(cli.trainer.strategy)}"


@pytest.mark.parametrize("form", ["registered_name", "class_path", "short_name"])
@pytest.mark.parametrize("name,cls,module", STRATEGY_FORMS, ids=[f[0] for f in STRATEGY_FORMS])
def test_strategy_forms_from_yaml(name, cls, module, form, tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} does not exist yet")
    strategy = {
        "registered_name": name,
        "class_path": {"class_path": f"{module}.{cls}"},
        "short_name": {"class_path": cls},
    }[form]
    cfg = {"trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy, "logger": False}}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = make_cli(["--config", str(path)], run=False)
    got = type(cli.trainer.strategy)
    assert got.__name__ == cls and got.__module__ == module, (
        f"strategy {strategy!r} resolved to {got}; string names need registration in lightning_qcomm/__init__.py "
        "and short names need the class imported by `import lightning_qcomm`"
    )


# ------------------------------------------------------------------------------------- training, 2 ranks


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config_worker(rank: int, port: int, configs: list[str], out_dir: str) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0"
    )
    torch.set_num_threads(1)
    sys.argv = ["lightning-qcomm"]
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    out = Path(out_dir)
    for cfg in configs:
        stem = Path(cfg).stem
        start = time.perf_counter()
        try:
            cli = make_cli(["fit", "--config", cfg, *TINY, f"--trainer.logger.init_args.save_dir={out / stem}"])
        except BaseException:
            (out / f"{stem}.rank{rank}.error").write_text(traceback.format_exc())
            raise  # the spawn context then stops the other rank
        logger_cb = _comm_logger(cli.trainer)
        totals = {
            f"{op}|{tag}": [t.calls, t.wire_bytes, t.baseline_bytes]
            for (op, tag), t in logger_cb.summary_totals.items()
        }
        result = {
            "strategy": type(cli.trainer.strategy).__name__,
            "global_step": cli.trainer.global_step,
            "totals": totals,
            "seconds": time.perf_counter() - start,
        }
        (out / f"{stem}.rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def config_runs(tmp_path_factory):
    """Train every runnable config in one two-rank spawn; returns (output dir, failure text or None)."""
    out = tmp_path_factory.mktemp("config_runs")
    runnable = [str(p) for p in CONFIGS if missing_module(p) is None]
    ctx = mp.start_processes(
        _config_worker, args=(_free_port(), runnable, str(out)), nprocs=2, start_method="spawn", join=False
    )
    deadline, failure = time.monotonic() + 150 + 25 * len(runnable), None
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                failure = "config runs timed out"
                break
    except Exception as err:  # a rank raised; its traceback is in <config>.rank<r>.error
        failure = str(err)
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    return out, failure


@pytest.mark.slow
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_trains_two_cpu_ranks(path, config_runs):
    _skip_if_missing(path)
    out, failure = config_runs
    errors = sorted(out.glob(f"{path.stem}.rank*.error"))
    assert not errors, errors[0].read_text()
    results = [out / f"{path.stem}.rank{r}.json" for r in (0, 1)]
    assert all(r.exists() for r in results), f"{path.name} did not run: {failure}"
    r0, r1 = (json.loads(r.read_text()) for r in results)
    assert r0["global_step"] == MAX_STEPS == r1["global_step"]
    assert r0["totals"] == r1["totals"], "the summary is summed over ranks, so every rank holds the same totals"
    assert r0["totals"], f"{path.name}: no collective was counted"
    wire = sum(v[1] for v in r0["totals"].values())
    baseline = sum(v[2] for v in r0["totals"].values())
    if r0["strategy"] == "DDPStrategy":
        assert wire == baseline and set(r0["totals"]) == {"all_reduce|grads"}
    elif r0["strategy"] in ("QSDPStrategy", "QuantDDPStrategy"):
        assert wire < baseline, f"{path.name}: a quantized strategy sent {wire} B >= fp32 baseline {baseline} B"
    metrics = list((out / path.stem).rglob("metrics.csv"))
    assert metrics and "comm/cum_bytes_sent" in metrics[0].read_text().splitlines()[0]


# ------------------------------------------------------------------------------------ README quickstart


@pytest.mark.slow
def test_readme_quickstart_reduced(tmp_path):
    """`lightning-qcomm fit --config configs/quickstart.yaml` as in the README, with fewer steps."""
    exe = shutil.which("lightning-qcomm")
    cmd = [exe] if exe else [sys.executable, "-m", "lightning_qcomm"]
    cmd += [
        "fit",
        "--config",
        str(REPO / "configs" / "quickstart.yaml"),
        "--trainer.max_steps=4",
        "--trainer.log_every_n_steps=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "lightning_qcomm communication summary: 2 rank(s), 4 optimizer steps" in proc.stdout, proc.stdout[-3000:]
    assert "train_loss = " in proc.stdout
    assert list(tmp_path.glob("runs/quickstart/version_*/metrics.csv"))
