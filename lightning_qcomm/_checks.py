"""Argument checks for every public constructor: a ``TypeError`` (wrong type) or ``ValueError`` (wrong value)
that names the owner, the argument, the value given and what is allowed.

No coercion: ``"no"`` is not a bool, ``"0"`` and ``1.7`` are not ints, ``True`` is not a number, NaN and
infinities are not sizes, and a timeout is a positive ``timedelta``. Used from every layer (it imports
nothing of the package).

Also the supported torch range, checked when the package is imported (``check_torch_version``).

Example::

    self.quantize_master = check_bool("QSDPStrategy", "quantize_master", quantize_master)
"""

from __future__ import annotations

import math
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

# torch releases the package supports: [first, end), as pyproject.toml's dependency says
TORCH_FIRST, TORCH_END = (2, 11), (2, 16)
SUPPORTED_TORCH = f">={TORCH_FIRST[0]}.{TORCH_FIRST[1]},<{TORCH_END[0]}.{TORCH_END[1]}"


def check_torch_version(version: str) -> None:
    """ImportError for a torch older than the supported range (naming it and how to install a CUDA build), one
    warning for a newer one (untested; FSDP2's internals may have moved: QSDP refuses at setup what it misses).

    Example::

        check_torch_version(torch.__version__)   # "2.10.0" -> ImportError: ... supports torch>=2.11,<2.16 ...
    """
    found = re.match(r"(\d+)\.(\d+)", str(version))
    if found is None:
        return
    release = (int(found.group(1)), int(found.group(2)))
    if release < TORCH_FIRST:
        raise ImportError(
            f"lightning_qcomm supports torch{SUPPORTED_TORCH}; this is torch {version}. Upgrade torch, e.g. "
            f'pip install "torch{SUPPORTED_TORCH}" (a CUDA build: add --index-url '
            "https://download.pytorch.org/whl/cu130, or your CUDA version's index)"
        )
    if release >= TORCH_END:
        warnings.warn(
            f"lightning_qcomm is tested with torch{SUPPORTED_TORCH}; this is torch {version}. QSDP reads FSDP2 "
            "internals that move between releases and refuses at setup what this torch lacks",
            stacklevel=3,
        )


def _where(owner: str, name: str, value: Any) -> str:
    return f"{owner}({name}={value!r})"


def check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{_where(owner, name, value)} must be a bool (True or False), got {type(value).__name__}")
    return value


def check_int(
    owner: str,
    name: str,
    value: Any,
    minimum: int | None = None,
    maximum: int | None = None,
    optional: bool = False,
) -> int | None:
    """An int (not a bool) within [minimum, maximum]; None allowed when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        allowed = "an int" + (" or None" if optional else "")
        raise TypeError(f"{_where(owner, name, value)} must be {allowed}, got {type(value).__name__}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            allowed = f"in {minimum}..{maximum}"
        else:
            allowed = f">= {minimum}" if minimum is not None else f"<= {maximum}"
        raise ValueError(f"{_where(owner, name, value)} is out of range; allowed: an int {allowed}")
    return value


def check_float(
    owner: str,
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    exclusive_minimum: bool = False,
    optional: bool = False,
) -> float | None:
    """A finite int or float (not a bool) within the bounds; None allowed when ``optional``."""
    if value is None and optional:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        allowed = "a number" + (" or None" if optional else "")
        raise TypeError(f"{_where(owner, name, value)} must be {allowed}, got {type(value).__name__}")
    low = minimum is not None and (value <= minimum if exclusive_minimum else value < minimum)
    if not math.isfinite(value) or low or (maximum is not None and value > maximum):
        bounds = []
        if minimum is not None:
            bounds.append(f"{'>' if exclusive_minimum else '>='} {minimum}")
        if maximum is not None:
            bounds.append(f"<= {maximum}")
        raise ValueError(
            f"{_where(owner, name, value)} is not allowed; allowed: a finite number {' and '.join(bounds)}"
        )
    return float(value)


def check_choice(owner: str, name: str, value: Any, allowed: Sequence[str], optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{_where(owner, name, value)} must be a str; allowed: {', '.join(allowed)}")
    if value not in allowed:
        raise ValueError(f"{_where(owner, name, value)} is not allowed; allowed: {', '.join(allowed)}")
    return value


def check_str(owner: str, name: str, value: Any, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        allowed = "a str" + (" or None" if optional else "")
        raise TypeError(f"{_where(owner, name, value)} must be {allowed}, got {type(value).__name__}")
    return value


def check_timeout(owner: str, value: Any, name: str = "timeout") -> timedelta | None:
    """A positive ``datetime.timedelta`` or None (torch.distributed's default)."""
    if value is None:
        return None
    if not isinstance(value, timedelta):
        raise TypeError(
            f"{_where(owner, name, value)} must be a datetime.timedelta or None, got {type(value).__name__} "
            "(e.g. timedelta(seconds=60); a bare number has no unit)"
        )
    if value <= timedelta(0):
        raise ValueError(f"{_where(owner, name, value)} is not allowed; allowed: a positive timedelta")
    return value


def check_writable_file(owner: str, name: str, value: Any) -> str | None:
    """A path (str or None) whose directory exists and is writable: checked when the object is made, not
    after a whole training run."""
    if value is None:
        return None
    path = check_str(owner, name, value, optional=True)
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise ValueError(f"{_where(owner, name, value)}: the directory {directory!r} does not exist or is not writable")
    if os.path.isdir(path):
        raise ValueError(f"{_where(owner, name, value)} is a directory; allowed: a file path")
    return path


def build_as(owner: str, cls: Any, values: Mapping[str, Any]) -> Any:
    """``cls`` (a config dataclass that checks itself) from the entries of ``values`` that are its fields (a
    constructor's ``locals()``), its argument errors naming ``owner``, the class the user called
    (``QSDPStrategy(seed=-1)``, not ``QSDPConfig(seed=-1)``)."""
    kwargs = {k: v for k, v in values.items() if k in cls.__dataclass_fields__}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace(f"{cls.__name__}(", f"{owner}(")) from None


START_METHODS = ("popen", "spawn", "fork", "forkserver")

__all__ = [
    "START_METHODS",
    "build_as",
    "check_bool",
    "check_choice",
    "check_float",
    "check_int",
    "check_str",
    "check_timeout",
    "check_writable_file",
]
