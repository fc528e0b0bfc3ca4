"""The comm, collectives and adapters layers reach a codec only through the codec layer's public door (docs/design.md,
"Architecture").

A collective codes through ``Codec.encode`` / ``decode``, the rows functions and ops of ``codecs.rows``
(``qcomm::encode_rows`` / ``decode_rows``) and ``codecs.sign_phases``; it does not import the codec layer's
backends (``PRIVATE_MODULES``: the fused C paths, the native library, the ops module's kernels, the Triton
kernels), does not import a ``_private`` name from the codec layer, and calls no ``_private`` method of anything
but itself (a codec's math hooks ``_scales``, ``_quantize``, ...; ``rng._mix32_``). ``NON_CODEC_PRIVATE`` lists
the private calls of comm that reach torch or FSDP, not a codec. Read with ``ast``, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "lightning_qcomm"
PRIVATE_MODULES = (
    "lightning_qcomm.codecs.cpu",
    "lightning_qcomm.codecs.cpu_fused",
    "lightning_qcomm.codecs.cuda",
    "lightning_qcomm.codecs.cuda_segments",
    "lightning_qcomm.codecs.native",
    "lightning_qcomm.codecs.ops",
    "lightning_qcomm.codecs.sign_ops",
    "lightning_qcomm.codecs.triton_probe",
    "lightning_qcomm.kernels",
)
# (file, call) private calls of comm modules on objects that are not codecs
NON_CODEC_PRIVATE = {
    ("averaging.py", "torch._foreach_copy_"),
    ("comm_worker.py", "pg._get_backend"),
    ("ddp/plan.py", "torch._foreach_copy_"),
    ("fsdp2/deferred.py", "torch._C._current_graph_task_id"),
    ("fsdp2/shim.py", "module._get_fsdp_state"),
    ("nonfinite.py", "torch._foreach_norm"),
    ("onebit/overlap.py", "target._on_grad"),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _is_private_module(module: str) -> bool:
    return any(module == m or module.startswith(m + ".") for m in PRIVATE_MODULES)


def private_codec_uses(comm_dir: Path) -> list[str]:
    """'file:line: what' for every import of a private codec backend or private codec-layer name, and every
    call of a ``_private`` attribute on anything but ``self`` / ``cls`` not in ``NON_CODEC_PRIVATE``."""
    problems = []
    for path in sorted(comm_dir.rglob("*.py")):
        name = path.relative_to(comm_dir).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            where = f"{name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                problems += [f"{where}: imports {a.name}" for a in node.names if _is_private_module(a.name)]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_qcomm."):
                mod = node.module
                for alias in node.names:
                    full = f"{mod}.{alias.name}"
                    codec_layer = mod.startswith(("lightning_qcomm.codecs", "lightning_qcomm.kernels"))
                    if _is_private_module(mod) or _is_private_module(full):
                        problems.append(f"{where}: imports {full}")
                    elif codec_layer and _private(alias.name):
                        problems.append(f"{where}: imports the private name {full}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _private(node.func.attr):
                recv = node.func.value
                if isinstance(recv, ast.Name) and recv.id in ("self", "cls"):
                    continue
                call = ast.unparse(node.func)
                if (name, call) not in NON_CODEC_PRIVATE:
                    problems.append(f"{where}: calls {call}")
    return problems


def test_comm_reaches_codecs_only_through_the_door():
    problems = [p for layer in ("comm", "collectives", "adapters") for p in private_codec_uses(ROOT / layer)]
    assert not problems, "comm, collectives or adapters reach below the codec layer's public door:\n" + "\n".join(
        problems
    )


def test_every_private_module_exists():
    """A backend that was renamed or merged away must leave the list, or the list checks nothing for it."""
    import importlib.util

    missing = [name for name in PRIVATE_MODULES if importlib.util.find_spec(name) is None]
    assert not missing, f"PRIVATE_MODULES names modules that do not exist: {missing}"


def test_checker_sees_every_form(tmp_path):
    """The checker itself can fail: one use of each form (those of the comm layer before the rows ops)."""
    (tmp_path / "a.py").write_text(
        "from lightning_qcomm.codecs import Codec, cpu_fused, native, ops, layout\n"
        "import lightning_qcomm.kernels.cuda.codec_kernels\n"
        "from lightning_qcomm.codecs.rng import _mix32_\n"
        "def f(codec, rows):\n"
        "    codec._scales(rows, rows)\n"
        "    self._fine()\n"
        "    ops.rows_kernel(codec, rows)\n"  # a public name of a private module: its import is what is flagged
        "    torch._C._current_graph_task_id()\n"  # private, not a codec, and not listed for this file
    )
    found = [p.split(": ", 1)[1] for p in private_codec_uses(tmp_path)]
    assert found == [
        "imports lightning_qcomm.codecs.cpu_fused",
        "imports lightning_qcomm.codecs.native",
        "imports lightning_qcomm.codecs.ops",
        "imports lightning_qcomm.kernels.cuda.codec_kernels",
        "imports the private name lightning_qcomm.codecs.rng._mix32_",
        "calls codec._scales",
        "calls torch._C._current_graph_task_id",
    ], found
