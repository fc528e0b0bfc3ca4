"""One clear line for the YAML mistakes users make most, before LightningCLI's usage text and tracebacks.

``lightning-qcomm`` reads each ``--config`` file first and looks at every ``class_path`` / ``init_args`` pair in it:

* an ``init_args`` key the class does not take (``grad_bitz: 8`` under ``QSDPStrategy``) is reported with the
  closest accepted name and the names it accepts:
  ``trainer.strategy.init_args.grad_bitz: QSDPStrategy takes no argument 'grad_bitz'; did you mean grad_bits? ...``
* a class of this package whose plain YAML values it refuses (``grad_bits: 9``) is reported with its own message,
  which names the argument and the allowed values:
  ``trainer.strategy: QSDPStrategy(grad_bits=9) is not supported by grad_codec='uniform'; allowed: 1..8, ...``

Anything this check cannot resolve (a class it cannot import, a value jsonargparse would convert first, a
``**kwargs`` constructor) is left to LightningCLI, which reports it as before. It builds nothing but our own
strategies and callbacks, whose constructors only check their arguments.

Example::

    problem = config_problem(["fit", "--config", "my.yaml"])
    if problem:
        sys.exit(f"lightning-qcomm: error: {problem}")
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

CONFIG_FLAGS = ("--config", "-c")
PLAIN = (int, float, str, bool, type(None))


def _config_files(args: list[str]) -> list[Path]:
    files = []
    for i, arg in enumerate(args):
        value = args[i + 1] if arg in CONFIG_FLAGS and i + 1 < len(args) else None
        if arg.startswith("--config="):
            value = arg[len("--config=") :]
        if value is not None and Path(value).is_file():
            files.append(Path(value))
    return files


def _class_specs(node: Any, where: str) -> Iterator[tuple[str, dict]]:
    """Every ``{class_path: ..., init_args: {...}}`` in a parsed YAML tree, with its dotted location."""
    if isinstance(node, dict):
        if isinstance(node.get("class_path"), str):
            yield where, node
        for key, value in node.items():
            yield from _class_specs(value, f"{where}.{key}" if where else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _class_specs(value, f"{where}[{i}]")


def resolve_class(class_path: str) -> type | None:
    """The class a ``class_path`` names: a dotted import path, or a short name of this package's (strategies,
    callbacks, the demo); None when it cannot be resolved here."""
    if "." in class_path:
        module, _, name = class_path.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), name, None)
        except ImportError:
            return None
        return obj if inspect.isclass(obj) else None
    for module in ("lightning_qcomm", "lightning_qcomm.demo"):
        obj = getattr(importlib.import_module(module), class_path, None)
        if inspect.isclass(obj):
            return obj
    return None


def _accepted(cls: type) -> list[str] | None:
    """The keyword arguments ``cls`` takes; None when it takes any (``**kwargs``)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def spec_problem(where: str, spec: dict) -> str | None:
    """The first problem of one ``class_path`` spec, as one line; None if there is none this check can see."""
    cls = resolve_class(spec["class_path"])
    init_args = spec.get("init_args") or {}
    if cls is None or not isinstance(init_args, dict):
        return None
    accepted = _accepted(cls)
    if accepted is not None:
        for key in init_args:
            if key not in accepted:
                close = difflib.get_close_matches(str(key), accepted, n=1, cutoff=0.6)
                hint = f"did you mean {close[0]}? " if close else ""
                return (
                    f"{where}.init_args.{key}: {cls.__name__} takes no argument {key!r}; {hint}"
                    f"accepted: {', '.join(accepted)}"
                )
    plain = all(isinstance(v, PLAIN) for v in init_args.values())
    if not plain or not cls.__module__.startswith("lightning_qcomm.") or cls.__module__ == "lightning_qcomm.demo":
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cls(**init_args)
    except ValueError as err:  # a TypeError may be a value jsonargparse converts first (a timeout, a path)
        return f"{where}: {err}"
    return None


def config_problem(args: list[str]) -> str | None:
    """The first problem in the ``--config`` files of a command line, as one line; None when none is found."""
    for path in _config_files(args):
        try:
            tree = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError):
            return None  # LightningCLI reports a file it cannot read or parse
        for where, spec in _class_specs(tree, ""):
            problem = spec_problem(where, spec)
            if problem:
                return f"{path.name}: {problem}"
    return None


__all__ = ["config_problem", "resolve_class", "spec_problem"]
