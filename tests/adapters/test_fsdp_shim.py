"""FSDP2's private state is read in one module (``adapters/fsdp2/shim.py``), each torch release gets its branch there, a
feature this torch lacks is refused naming the first release that has it, and the package names the supported
torch range when imported on an older one (docs/design.md, "The FSDP2 shim").

The private names are read from the installed torch's own ``torch/distributed/fsdp/_fully_shard/`` sources (what
its FSDP classes store on ``self``, their methods, the modules' functions and classes), so the check follows
whichever torch runs it.
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from lightning_qcomm.adapters.fsdp2 import shim as fsdp_shim

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_qcomm"
SHIM = PACKAGE / "adapters" / "fsdp2" / "shim.py"
FSDP2_CLASSES = ("FSDPParam", "FSDPParamGroup", "FSDPState", "FSDPCommContext", "FSDPStateContext")
# names torch's FSDP2 sources define that are just as much Lightning's or ours (a strategy's ``_device``, a model's
# ``init``): not evidence of reaching into FSDP2
GENERIC = {"_device", "init"}


def _fsdp2_private_names() -> set[str]:
    root = Path(torch.__file__).parent / "distributed" / "fsdp" / "_fully_shard"
    names: set[str] = set()
    for path in root.glob("*.py"):
        names.add(path.stem)
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef) and node.name in FSDP2_CLASSES:
                for sub in ast.walk(node):
                    if isinstance(sub, ast.FunctionDef):
                        names.add(sub.name)
                    if (
                        isinstance(sub, ast.Attribute)
                        and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                    ):
                        names.add(sub.attr)
    public = {n for n in dir(FSDPModule) if not n.startswith("_")} | set(dir(nn.Module)) | set(dir(torch.Tensor))
    return {n for n in names if n not in public and n not in GENERIC and not n.startswith("__")} | {"_get_fsdp_state"}


def _named(path: Path, private: set[str]) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value  # getattr(obj, "name")
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            name = next((part for m in modules for part in m.split(".") if part in private), None)
        else:
            continue
        if name in private:
            found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}")
    return found


def test_only_the_shim_names_private_fsdp2_state():
    private = _fsdp2_private_names()
    assert {"_fsdp_param_group", "fsdp_params", "_sharded_param_data", "foreach_reduce"} <= private  # read, not empty
    assert _named(SHIM, private), "the shim itself must show up, else the scan sees nothing"
    offenders = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != SHIM for hit in _named(path, private)]
    assert offenders == []


def test_param_groups_branch_per_release():
    one = type("State211", (), {"_fsdp_param_group": "g"})()  # torch 2.11: one group or None
    many = type("State212", (), {"_fsdp_param_groups": ["g", "h"]})()  # torch 2.12+: a list
    assert fsdp_shim._param_groups(one) == ["g"]
    assert fsdp_shim._param_groups(type("Empty211", (), {"_fsdp_param_group": None})()) == []
    assert fsdp_shim._param_groups(many) == ["g", "h"]
    with pytest.raises(RuntimeError, match=rf"torch {re.escape(torch.__version__)}.*_fsdp_param_groups"):
        fsdp_shim._param_groups(object())


def test_running_torch_is_a_reviewed_release():
    """Each torch of the supported range runs a foreach_reduce the overlap was reviewed against."""
    fsdp_shim._contract_cache.clear()
    minor = tuple(int(x) for x in torch.__version__.split(".")[:2])
    assert fsdp_shim.reduce_contract() == ("2.15" if minor >= (2, 15) else "2.11")


def test_unreviewed_foreach_reduce_runs_inline_logged_once(monkeypatch, caplog):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    def foreach_reduce(fsdp_params, unsharded_grads, some_new_argument):  # a later release's shape
        raise AssertionError("never called")

    monkeypatch.setattr(_fsdp_collectives, "foreach_reduce", foreach_reduce)
    monkeypatch.setattr(fsdp_shim, "_contract_cache", [])
    with caplog.at_level(logging.WARNING, logger=fsdp_shim.__name__):
        assert fsdp_shim.reduce_contract() is None
        assert fsdp_shim.reduce_contract() is None
        group = type("Group", (), {"fsdp_params": []})()
        module = type("M", (), {"_get_fsdp_state": lambda self: type("S", (), {"_fsdp_param_groups": [group]})()})()
        assert not fsdp_shim.output_only_viewed(module, torch.float32, in_all_reduce_hook=False)
    assert len([r for r in caplog.records if "run inline" in r.getMessage()]) == 1


def test_feature_missing_from_this_torch_is_refused_with_the_first_release(monkeypatch):
    if hasattr(FSDPModule, "reset_iter_state"):
        monkeypatch.delattr(FSDPModule, "reset_iter_state")
    with pytest.raises(RuntimeError) as err:
        fsdp_shim.require("reset_iter_state", "QSDPHandle")
    msg = str(err.value)
    assert "QSDPHandle.reset_iter_state" in msg and torch.__version__ in msg and "torch>=2.13" in msg


def test_the_running_torch_has_what_qsdp_needs():
    fsdp_shim.check_torch_fsdp_api()
    assert fsdp_shim.AllGather is not object and inspect.isclass(fsdp_shim.ReduceScatter)


@pytest.mark.parametrize(
    ("version", "outcome"),
    [("2.10.1+cu128", "ImportError"), ("2.9.0", "ImportError"), ("2.16.0", "UserWarning"), ("2.13.0+cpu", "ok")],
)
def test_import_names_the_supported_range(version, outcome):
    code = (
        "import warnings, torch\n"
        f"torch.__version__ = {version!r}\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    try:\n"
        "        import lightning_qcomm\n"
        "    except ImportError as e:\n"
        "        print('ImportError', e)\n"
        "    else:\n"
        "        hits = [str(x.message) for x in w if 'lightning_qcomm is tested with' in str(x.message)]\n"
        "        print('UserWarning ' + hits[0] if hits else 'ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300).stdout.strip()
    line = out.splitlines()[-1]
    assert line.startswith(outcome), out
    if outcome != "ok":
        assert "torch>=2.11,<2.16" in line and version in line
