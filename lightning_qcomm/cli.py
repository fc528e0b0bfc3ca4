"""``lightning-qcomm`` (and ``python -m lightning_qcomm``): LightningCLI with lightning_qcomm preloaded (Lightning
layer; docs/design.md, "Entry points: Trainer, Fabric and plain torch").

Importing the package registers the strategy names (``strategy: quant_ddp``) and makes our classes resolvable by
short name (``class_path: QuantDDPStrategy``, ``--trainer.callbacks+=CommVolumeLogger``); they work as well in a
user's own ``LightningCLI``. This entry point adds:

* **Configs by name.** ``--config quickstart.yaml`` (or ``quickstart``) finds the configs shipped inside the package
  when no such file exists where the user stands (:func:`resolve_config`); an existing path always wins.
* **A named class starts from its own defaults.** Naming a model or data class on the command line discards what an
  earlier ``--config`` set for ``model`` (``data``), so jsonargparse does not carry the demo's ``init_args`` over;
  arguments given after it apply.
* **One line for a YAML mistake.** A misspelled ``init_args`` key or a refused value is reported first, in one line
  with the closest accepted name or the allowed values (``cli_checks``).

There is no default model: the demo (``lightning_qcomm.demo.ByteGPT`` on ``StdlibBytes``) comes only from the
configs that name it.

Example::

    lightning-qcomm fit --config quickstart.yaml
    lightning-qcomm fit --config configs/quant_ddp_nuqsgd4.yaml --model mypkg.MyModel --data mypkg.MyData
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import yaml
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_info

import lightning_qcomm  # noqa: F401  (registers strategy names)
import lightning_qcomm.callbacks  # noqa: F401  (short callback names)
import lightning_qcomm.strategies  # noqa: F401  (short strategy names)
from lightning_qcomm.cli_checks import CONFIG_FLAGS, config_problem

CLASS_KEYS = ("model", "data")


def configs_dir() -> Path:
    """The directory of the YAML configs that ship with the package.

    An installed wheel holds them at ``lightning_qcomm/configs/`` (``pyproject.toml`` maps the repository's
    ``configs/`` there); an editable install or a source checkout reads the repository's ``configs/``.
    """
    package = Path(__file__).resolve().parent
    for candidate in (package / "configs", package.parent / "configs"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"no configs directory next to {package} (a broken install?)")


def resolve_config(value: str) -> str:
    """``value`` itself if it is an existing path, else the shipped config it names, else ``value`` unchanged.

    A name matches by file name with or without ``.yaml`` (``configs/quickstart.yaml``, ``quickstart``).
    Values that are not a plain path (a YAML/JSON string) are returned unchanged.
    """
    if Path(value).exists() or "\n" in value or value.lstrip().startswith(("{", "[")):
        return value
    name = Path(value).name
    for candidate in (name, f"{name}.yaml"):
        path = configs_dir() / candidate
        if path.is_file():
            rank_zero_info(f"lightning-qcomm: --config {value} -> {path}")
            return str(path)
    return value


def _names_class(key: str, arg: str, following: str | None) -> tuple[bool, int]:
    """Whether ``arg`` (with its value ``following``) names a class for ``key``; and how many tokens it spans."""
    for flag in (f"--{key}", f"--{key}.class_path"):
        if arg == flag:
            return following is not None and _is_class_value(following, flag.endswith("class_path")), 2
        if arg.startswith(flag + "="):
            return _is_class_value(arg[len(flag) + 1 :], flag.endswith("class_path")), 1
    return False, 1


def _is_class_value(value: str, is_class_path: bool) -> bool:
    """Whether a ``--model`` / ``--data`` value picks a class (a name, or a JSON/YAML spec with ``class_path``)."""
    if is_class_path:
        return True
    text = value.strip()
    if text.startswith("{") or text.endswith((".yaml", ".yml", ".json")):
        try:
            spec = yaml.safe_load(Path(text).read_text() if Path(text).is_file() else text)
        except (OSError, yaml.YAMLError):
            return False
        return isinstance(spec, dict) and "class_path" in spec
    return bool(text) and text.lower() not in ("null", "none") and not text.startswith(("-", "["))


def prepare_args(args: list[str]) -> list[str]:
    """Rewrite a command line: shipped configs by name, and a reset before every model/data class it names."""
    out: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        following = args[i + 1] if i + 1 < len(args) else None
        if arg in CONFIG_FLAGS and following is not None:
            out += [arg, resolve_config(following)]
            i += 2
            continue
        if arg.startswith("--config="):
            out.append("--config=" + resolve_config(arg[len("--config=") :]))
            i += 1
            continue
        for key in CLASS_KEYS:
            named, span = _names_class(key, arg, following)
            if named:
                out.append(f"--{key}=null")  # forget an earlier config's class and its init_args
                break
        else:
            span = 1
        out += args[i : i + span]
        i += span
    return out


class QCommCLI(LightningCLI):
    """LightningCLI over any LightningModule / LightningDataModule, with configs by name (see module docstring)."""

    def parse_arguments(self, parser: LightningArgumentParser, args: list[str] | dict | None) -> None:
        if args is None:  # the real command line (LightningCLI warns when given args and argv both)
            self.config = parser.parse_args(check_configs(prepare_args(sys.argv[1:])))
            return
        super().parse_arguments(parser, check_configs(prepare_args(args)) if isinstance(args, list) else args)


def check_configs(args: list[str]) -> list[str]:
    """``args`` unchanged, after exiting with status 2 and one line on stderr (``lightning-qcomm: error: ...``) for
    the first mistake ``cli_checks.config_problem`` finds in its ``--config`` files: an ``init_args`` key a class
    does not take (with the closest accepted name), a value one of our classes refuses (with what it allows)."""
    problem = config_problem(args)
    if problem:
        print(f"lightning-qcomm: error: {problem}", file=sys.stderr)
        sys.exit(2)
    return args


def make_cli(args: list[str] | None = None, run: bool = True) -> QCommCLI:
    """Build (and with ``run`` execute) the CLI; returns it, so callers can read ``cli.trainer``, ``cli.model``.

    ``args`` defaults to ``sys.argv[1:]``; ``run=False`` only parses and instantiates (no subcommand in ``args``).

    Example::

        cli = make_cli(["--config", "quickstart.yaml", "--trainer.max_steps=4"], run=False)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    """
    import lightning_qcomm.demo  # noqa: F401  (demo classes resolvable by short name too)

    return QCommCLI(
        pl.LightningModule,
        pl.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        run=run,
        save_config_kwargs={"overwrite": True},
    )


def main(args: list[str] | None = None) -> None:
    """Console-script entry point (``lightning-qcomm``); returns None so the exit status is 0 on success."""
    make_cli(args)
