"""Every public function and class exported from ``lightning_qcomm`` and ``lightning_qcomm.parallel`` carries a
short ``Example::`` in its own docstring (README, "Architecture"; the rules for docstrings in docs/design.md)."""

from __future__ import annotations

import inspect

import lightning_qcomm
import lightning_qcomm.parallel

PENDING: set[str] = set()  # names whose example is owed (none)


def _public_objects() -> dict[str, object]:
    out = {}
    for mod in (lightning_qcomm, lightning_qcomm.parallel):
        for name in mod.__all__:
            obj = getattr(mod, name)
            if inspect.isclass(obj) or inspect.isfunction(obj):
                out[name] = obj
    return out


def _own_doc(obj: object) -> str:
    """The docstring written on obj itself (a class does not inherit its base's here)."""
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    return doc or ""


def test_public_api_has_examples():
    objs = _public_objects()
    assert len(objs) > 30  # the export lists were read (not an empty walk)
    missing = [name for name, obj in sorted(objs.items()) if name not in PENDING and "Example::" not in _own_doc(obj)]
    assert not missing, f"no Example:: in the docstring of {missing}"
