"""LightningCLI entry point and configs/: every YAML parses and trains (2 CPU ranks), strategy name forms, quickstart.

* Every ``configs/*.yaml`` is instantiated in-process (parse + class resolution) and then trained for a few steps
  with a tiny model, all configs in one two-rank spawn (the workers set ``LOCAL_RANK`` so Lightning uses them
  as its ranks instead of launching its own). A config whose strategy or callback module does not exist yet is
  skipped with the reason, so it starts running when that module lands.
* ``trainer.strategy`` as a registered string, as a full ``class_path`` and as a short class name.
* A user's own model and data under ``lightning-qcomm``: ``--print_config`` shows exactly their classes' defaults,
  with or without one of our configs before them (the demo's arguments never carry over).
* Our classes in a user's own ``LightningCLI`` YAML (the README's first snippet), and configs found by name.
* The README's commands, the demo reduced to a few steps, run as a real subprocess: the summary table and the
  loss-vs-bytes PNG.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import traceback
import zipfile
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
import yaml
from _launch import free_port, spawn
from lightning.pytorch.cli import LightningCLI

from lightning_qcomm.callbacks import CommVolumeLogger
from lightning_qcomm.cli import make_cli

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
sys.path.insert(0, str(REPO / "benchmarks"))
from gpu_smoke import TINY as TINY_MODEL  # noqa: E402  (the demo model at one layer, as the GPU smoke run uses it)

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
CPU = "--trainer.accelerator=cpu"  # the configs say `auto` (GPUs where present); the tests run them on CPU ranks
TINY = [  # every config trains MAX_STEPS steps of the one-layer demo model in about a second
    CPU,
    f"--trainer.max_steps={MAX_STEPS}",
    f"--trainer.val_check_interval={MAX_STEPS}",
    *TINY_MODEL,
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
    cli = make_cli(["--config", str(path), CPU, f"--trainer.logger.init_args.save_dir={tmp_path}"], run=False)
    assert cli.trainer.num_devices == 2 and cli.trainer.accelerator.__class__.__name__ == "CPUAccelerator"
    _comm_logger(cli.trainer)
    declared = yaml.safe_load(path.read_text())["trainer"]["strategy"]
    name = declared if isinstance(declared, str) else declared["class_path"].rsplit(".", 1)[-1]
    module = REQUIRES.get(name)
    if module:  # the configured class (or the class the registered name stands for) was built
        assert type(cli.trainer.strategy).__module__ == module, f"{path.name}: got {type(cli.trainer.strategy)}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_runs_on_gpus_unchanged(path):
    """Every config but the quickstart says ``accelerator: auto`` (GPUs with NCCL where present); the quickstart is
    the CPU demo. None pins a process-group backend (gloo would keep GPU tensors off NCCL)."""
    trainer = yaml.safe_load(path.read_text())["trainer"]
    expected = "cpu" if path.stem == "quickstart" else "auto"
    assert trainer.get("accelerator") == expected, f"{path.name}: accelerator {trainer.get('accelerator')!r}"
    strategy = trainer.get("strategy")
    init_args = strategy.get("init_args", {}) if isinstance(strategy, dict) else {}
    assert "process_group_backend" not in init_args, f"{path.name} pins a backend: {init_args}"


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
    cfg = {
        "trainer": {"accelerator": "cpu", "devices": 2, "strategy": strategy, "logger": False},
        "model": "lightning_qcomm.demo.ByteGPT",  # no default model: the demo is named like any other
        "data": "lightning_qcomm.demo.StdlibBytes",
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = make_cli(["--config", str(path)], run=False)
    got = type(cli.trainer.strategy)
    assert got.__name__ == cls and got.__module__ == module, (
        f"strategy {strategy!r} resolved to {got}; string names need registration in lightning_qcomm/__init__.py "
        "and short names need the class imported by `import lightning_qcomm`"
    )


def _onebit_yaml(tmp_path, init_args: dict) -> Path:
    cfg = {
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "ddp",
            "logger": False,
            "callbacks": [{"class_path": "OneBitAdamCallback", "init_args": init_args}],
        },
        "model": "lightning_qcomm.demo.ByteGPT",
        "data": "lightning_qcomm.demo.StdlibBytes",
    }
    path = tmp_path / "onebit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    "init_args,expect",
    [({}, (256, 128)), ({"variance_refresh": 64, "scale_block": 0}, (0, 64)), ({"variance_refresh": 0}, (256, 0))],
    ids=["defaults", "set", "refresh_off"],
)
def test_onebit_adam_settings_from_yaml(init_args, expect, tmp_path, monkeypatch):
    """``scale_block`` and ``variance_refresh`` reach the callback's OneBitAdam settings from a YAML config."""
    from lightning_qcomm.callbacks import OneBitAdamCallback

    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    cli = make_cli(["--config", str(_onebit_yaml(tmp_path, {"freeze_step": 5, **init_args}))], run=False)
    (cb,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, OneBitAdamCallback)]
    assert (cb.config.scale_block, cb.config.variance_refresh) == expect
    assert cb.config.freeze_step == 5


def test_onebit_adam_bad_variance_refresh_from_yaml_names_class_argument_and_allowed(tmp_path, monkeypatch, capsys):
    """The CLI exits with status 2 and the callback's ValueError, naming where in the file it is."""
    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    with pytest.raises(SystemExit) as exit_info:
        make_cli(["--config", str(_onebit_yaml(tmp_path, {"variance_refresh": -3}))], run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "trainer.callbacks[0]: OneBitAdamCallback(variance_refresh=-3): allowed 0" in err
    assert "an int >= 1" in err


# ------------------------------------------------------------------------- a user's own model and data


class UserModel(pl.LightningModule):
    """A user's model whose argument names overlap ByteGPT's (lr, block_size, n_layer) with other defaults."""

    def __init__(self, lr: float = 0.1, block_size: int = 35, n_layer: int = 2, hidden: int = 7) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(hidden, 1)


class UserData(pl.LightningDataModule):
    """A user's data module whose argument names overlap StdlibBytes' (batch_size, block_size, max_bytes)."""

    def __init__(self, batch_size: int = 3, block_size: int = 35, max_bytes: int = 500) -> None:
        super().__init__()
        self.save_hyperparameters()


USER_MODEL = {
    "class_path": f"{__name__}.UserModel",
    "init_args": {"lr": 0.1, "block_size": 35, "n_layer": 2, "hidden": 7},
}
USER_DATA = {"class_path": f"{__name__}.UserData", "init_args": {"batch_size": 3, "block_size": 35, "max_bytes": 500}}
NAMING_FORMS = {  # the ways LightningCLI lets a user name the class on the command line
    "space": lambda key, cls: [f"--{key}", cls],
    "equals": lambda key, cls: [f"--{key}={cls}"],
    "class_path": lambda key, cls: [f"--{key}.class_path", cls],
    "json": lambda key, cls: [f"--{key}", json.dumps({"class_path": cls})],
}


def _printed_config(args: list[str], capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        make_cli(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("form", sorted(NAMING_FORMS))
@pytest.mark.parametrize("config", [None, "quickstart.yaml", "onebit_adam.yaml"])
def test_user_model_and_data_get_their_own_defaults(config, form, capsys, monkeypatch):
    """`lightning-qcomm fit [--config ours] --model mypkg.MyModel --data mypkg.MyData`: nothing of the demo carries over."""
    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    args = ["--config", str(REPO / "configs" / config)] if config else []
    args += NAMING_FORMS[form]("model", USER_MODEL["class_path"]) + NAMING_FORMS[form]("data", USER_DATA["class_path"])
    cfg = _printed_config(args, capsys)
    assert cfg["model"] == USER_MODEL
    assert cfg["data"] == USER_DATA
    if config:  # the rest of our config still applies
        assert cfg["trainer"]["devices"] == 2


def test_user_arguments_after_the_class_still_apply(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    cfg = _printed_config(
        [
            "--config",
            str(REPO / "configs" / "quickstart.yaml"),
            "--model",
            USER_MODEL["class_path"],
            "--model.lr=0.5",
            "--model.init_args.hidden=9",
            "--data",
            USER_DATA["class_path"],
            "--data.batch_size=8",
        ],
        capsys,
    )
    assert cfg["model"]["init_args"] == {**USER_MODEL["init_args"], "lr": 0.5, "hidden": 9}
    assert cfg["data"]["init_args"] == {**USER_DATA["init_args"], "batch_size": 8}


def test_model_from_its_own_yaml_file(tmp_path, capsys, monkeypatch):
    """`--model model.yaml`: a file naming a class starts it fresh; a file of init_args only keeps the class."""
    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    quickstart = ["--config", str(REPO / "configs" / "quickstart.yaml")]
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({"class_path": USER_MODEL["class_path"]}))
    (tmp_path / "lr.yaml").write_text(yaml.safe_dump({"init_args": {"lr": 0.5}}))
    cfg = _printed_config([*quickstart, "--model", str(tmp_path / "mine.yaml")], capsys)
    assert cfg["model"] == USER_MODEL
    cfg = _printed_config([*quickstart, "--model", str(tmp_path / "lr.yaml")], capsys)
    assert cfg["model"]["class_path"] == "lightning_qcomm.demo.ByteGPT" and cfg["model"]["init_args"]["lr"] == 0.5
    assert cfg["model"]["init_args"]["block_size"] == 128  # the config's other values stay


def test_no_model_named_means_no_demo_model(capsys, monkeypatch):
    """The demo comes only from its own config: a bare `lightning-qcomm fit` does not pick ByteGPT for the user."""
    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    cfg = _printed_config(["--trainer.accelerator=cpu"], capsys)
    assert cfg["model"] is None and cfg["data"] is None


@pytest.mark.parametrize("name", ["quickstart.yaml", "quickstart", "configs/quickstart.yaml"])
def test_config_found_by_name_outside_the_checkout(name, tmp_path, monkeypatch):
    """An installed wheel ships configs/: `lightning-qcomm fit --config quickstart.yaml` works from any directory."""
    monkeypatch.setattr(sys, "argv", ["lightning-qcomm"])
    monkeypatch.chdir(tmp_path)
    cli = make_cli(["--config", name, "--trainer.logger=false"], run=False)
    assert type(cli.model).__name__ == "ByteGPT" and type(cli.datamodule).__name__ == "StdlibBytes"
    assert type(cli.trainer.strategy).__name__ == "QSDPStrategy"


def _readme_block(lang: str, index: int = 0) -> str:
    blocks = re.findall(rf"```{lang}\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
    assert len(blocks) > index, f"README.md has no ```{lang} block number {index}"
    return blocks[index]


def test_readme_first_yaml_in_a_plain_lightningcli(tmp_path, monkeypatch):
    """The README's first snippet: our classes by class_path in the user's own LightningCLI, with their model."""
    monkeypatch.setattr(sys, "argv", ["my_train.py"])
    snippet = yaml.safe_load(_readme_block("yaml"))
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(snippet))
    cli = LightningCLI(
        UserModel,
        UserData,
        args=["--config", str(path), "--trainer.logger=false"],
        run=False,
        save_config_callback=None,
    )
    strategy = snippet["trainer"]["strategy"]["class_path"]
    assert strategy.startswith("lightning_qcomm.") and type(cli.trainer.strategy).__name__ == strategy.rsplit(".", 1)[1]
    names = {type(cb).__name__ for cb in cli.trainer.callbacks}
    assert {cb["class_path"].rsplit(".", 1)[1] for cb in snippet["trainer"]["callbacks"]} <= names
    assert cli.model.hparams.lr == 0.1  # the user's defaults


# ----------------------------------------------------------------------------------------------- the wheel


@pytest.mark.slow
def test_wheel_ships_configs_and_types_and_no_hard_triton(tmp_path):
    """Build the wheel from a copy of the sources: configs and py.typed inside, triton only as an extra."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in ("lightning_qcomm", "configs", "kernels"):  # kernels/: cuda/ (Triton), cpu/ (C++ sources)
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("lightning_qcomm-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (meta_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        meta = zf.read(meta_name).decode()
        zf.extractall(tmp_path / "site")
    assert {f"lightning_qcomm/configs/{p.name}" for p in CONFIGS} <= names
    kernels = {"kernels/__init__.py", "kernels/cuda/codec_kernels.py", "kernels/cuda/wire_params.py"}
    assert {"lightning_qcomm/py.typed", *(f"lightning_qcomm/{n}" for n in kernels)} <= names
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    hard = [r for r in requires if "extra ==" not in r]
    assert not any(r.startswith("triton") for r in hard), hard
    assert any(r.startswith("triton") and 'extra == "triton"' in r for r in requires), requires
    assert any(r.startswith("matplotlib") and 'extra == "plot"' in r for r in requires), requires
    (torch_req,) = [r for r in hard if re.match(r"torch\b", r)]
    # the range the package checks at import (lightning_qcomm._checks), the same in the wheel's metadata
    from lightning_qcomm._checks import TORCH_END, TORCH_FIRST

    first, end = ".".join(map(str, TORCH_FIRST)), ".".join(map(str, TORCH_END))
    assert sorted(torch_req[len("torch") :].split(",")) == sorted([f"<{end}", f">={first}"]), torch_req
    # one process from a directory without configs/: the installed package finds its own configs by name, and its
    # C++ sources ship too, from which it builds and loads its CPU kernels
    assert {"lightning_qcomm/kernels/cpu/qcomm_ops.cpp", "lightning_qcomm/kernels/cpu/qcomm_kernels.h"} <= names
    probe = (
        "from lightning_qcomm.cli import configs_dir, resolve_config; print(configs_dir()); "
        "print(resolve_config('quickstart')); "
        "import lightning_qcomm.kernels as k; from lightning_qcomm.codecs import native; print(native.CSRC); "
        "print(native.load() or native.load_error()); print(k.__path__)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    found_dir, found, csrc, lib, kernels_path = out.stdout.split("\n")[:5]
    assert Path(found_dir) == tmp_path / "site" / "lightning_qcomm" / "configs"
    assert Path(found) == Path(found_dir) / "quickstart.yaml"
    assert Path(csrc) == tmp_path / "site" / "lightning_qcomm" / "kernels" / "cpu"
    assert kernels_path == repr([str(tmp_path / "site" / "lightning_qcomm" / "kernels")])  # the wheel's, alone
    assert Path(lib).parent.parent == tmp_path / "ext", out.stdout


# ------------------------------------------------------------------------------------- training, 2 ranks


def _quant_ddp_auto(path: Path) -> bool:
    """A QuantDDP config with codec="auto": its first 12 steps are trial steps, fp32 first."""
    strategy = yaml.safe_load(path.read_text())["trainer"].get("strategy")
    if not isinstance(strategy, dict) or not strategy["class_path"].endswith("QuantDDPStrategy"):
        return False
    return strategy.get("init_args", {}).get("codec") == "auto"


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
    failure = None
    try:
        spawn(_config_worker, free_port(), runnable, str(out), nprocs=2, timeout_s=150 + 25 * len(runnable))
    except TimeoutError:
        failure = "config runs timed out"
    except Exception as err:  # a rank raised; its traceback is in <config>.rank<r>.error
        failure = str(err)
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
    elif _quant_ddp_auto(path):  # the 4 steps are the trial's fp32 steps: DDP's bytes exactly
        calls, wire, baseline = r0["totals"]["all_reduce|grads"]
        assert calls > 0 and wire == baseline, r0["totals"]
    elif r0["strategy"] in ("QSDPStrategy", "QuantDDPStrategy"):
        assert wire < baseline, f"{path.name}: a quantized strategy sent {wire} B >= fp32 baseline {baseline} B"
    metrics = list((out / path.stem).rglob("metrics.csv"))
    assert metrics and "comm/cum_bytes_sent" in metrics[0].read_text().splitlines()[0]


# ------------------------------------------------------------------------------------ README quickstart


README_REDUCED = ["--trainer.max_steps=4", "--trainer.log_every_n_steps=2", "--trainer.val_check_interval=4"]


@pytest.mark.slow
def test_readme_commands(tmp_path):
    """The README's first commands as a user types them, the demo reduced to 4 steps, run where no configs/ is.

    The demo prints the summary with the vs-DDP headline and draws the loss-vs-bytes PNG next to its logs."""
    block = _readme_block("bash")
    assert "python -m pytest" in block  # the tests command (not run from inside the tests)
    demos = [shlex.split(line.split("#")[0]) for line in block.splitlines() if line.startswith("lightning-qcomm fit")]
    assert demos, "README's first bash block has no `lightning-qcomm fit` command"
    exe = shutil.which("lightning-qcomm")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for argv in demos:
        cmd = ([exe] if exe else [sys.executable, "-m", "lightning_qcomm"]) + argv[1:] + README_REDUCED
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out = proc.stdout
        assert "lightning_qcomm communication summary: 2 rank(s), 4 optimizer steps" in out, out[-3000:]
        assert "vs DDP fp32 (this answers 'how much less than DDP'): training steps sent" in out
        assert "(how well the codecs compress, not the saving against DDP;" in out and "train_loss = " in out
        (run_dir,) = tmp_path.glob("runs/quickstart/version_*")
        assert (run_dir / "metrics.csv").exists()
        png = run_dir / "loss_vs_bytes.png"
        assert f"loss vs bytes: {png.relative_to(tmp_path)}" in out, out[-2000:]
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _tiny_demo_fit(tmp_path: Path) -> pl.Trainer:
    from lightning.pytorch.loggers import CSVLogger

    from lightning_qcomm.demo import ByteGPT, LossVsBytesPlot, StdlibBytes

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        limit_val_batches=0,
        logger=CSVLogger(str(tmp_path), name="tiny"),
        callbacks=[CommVolumeLogger(summary=False), LossVsBytesPlot()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    model = ByteGPT(n_layer=1, n_head=2, n_embd=32, block_size=32, warmup_steps=1)
    trainer.fit(model, datamodule=StdlibBytes(block_size=32, batch_size=4, max_bytes=40000))
    return trainer


def test_loss_vs_bytes_plot_one_process(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    trainer = _tiny_demo_fit(tmp_path)
    png = Path(trainer.log_dir) / "loss_vs_bytes.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"loss vs bytes: {png}" in capsys.readouterr().out


def test_loss_vs_bytes_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):  # as if not installed
        monkeypatch.setitem(sys.modules, name, None)  # importing it now raises ImportError
    with pytest.warns(UserWarning, match=r"pip install lightning-qcomm\[plot\]"):
        _tiny_demo_fit(tmp_path)
    assert not list(tmp_path.rglob("*.png"))


def test_ci_runs_the_readme_test_command_verbatim():
    """CI runs what a user runs: the README's test line (the one running pytest) appears as is in .ci/run."""
    readme = [ln for ln in (REPO / "README.md").read_text().splitlines() if "python -m pytest" in ln]
    assert readme, "README.md has no pytest command"
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert readme[0] in ci, f"README's test command is not a line of .ci/run: {readme[0]!r}"
