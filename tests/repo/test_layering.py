"""The layer order holds: no module of lightning_qcomm imports from a layer above its own. The layers and the file
map are in docs/design.md, "Layers and files"; ``LAYERS`` below is their machine form (the top-level ``kernels/``
installs as ``lightning_qcomm.kernels``).

Imports within one layer are free. Every import counts, also those inside functions and under
``TYPE_CHECKING``. Read with ``ast``, nothing is imported. Two rules besides the order: the kernels, below the
codec layer, read only its leaf spec modules (constants and layouts that import nothing of the package); and no
adapter names a backend of the codec layer (the dispatcher is the only chooser: adapters call the codec door).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "lightning_qcomm"
REPO = Path(__file__).resolve().parents[2]
ROOT = REPO / PACKAGE
# top-level folders of the repository that install inside the package (pyproject.toml's package-dir)
MAPPED = (REPO / "kernels",)  # lightning_qcomm.kernels.cuda, ...

LAYERS = {
    "_checks": 0,
    "_log": 0,
    "kernels": 0,  # the device kernels, below the codec layer: they read only its leaf spec modules (LEAF_READS)
    "codecs": 0.5,  # the codec layer over its kernels (layer 0 of docs/design.md's six, in two)
    "comm": 1,
    "collectives": 2,
    "adapters": 3,
    "optim": 3,
    "memory": 3,
    "parallel": 4,
    "strategies": 5,
    "callbacks": 5,
    "fabric": 5,
    "cli": 5,
    "cli_checks": 5,
    "demo": 5,
    "consolidate": 5,
    "__main__": 5,
    "": 5,  # the package root (lightning_qcomm/__init__.py re-exports every layer)
}


# (reader, read): modules of ``reader`` may import the leaf modules of ``read`` (a layer above them) and no other
LEAF_READS = (("kernels", "codecs"),)
# the codec layer's backends: no module of ``adapters`` imports these modules of ``codecs`` or these names from it
CODEC_BACKEND_MODULES = frozenset(
    {"cpu", "cpu_fused", "cuda", "cuda_segments", "native", "triton_probe", "ops", "sign_ops", "sign_phases"}
)
CODEC_BACKEND_NAMES = frozenset(
    {
        "c_pass_available",
        "rows_one_by_one",
        "encode_row_into",
        "encode_flat_row_into",
        "segments_kernel",
        "rows_kernel",
        "kernels_for",
        "use_fused",
    }
)
PER_DEVICE_SUFFIXES = ("_cuda", "_fake", "_reference", "_kernel", "_body")  # one device's form of an op


def _module_name(path: Path, root: Path, package: str) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _component(module: str, root: Path, package: str) -> str:
    """The first name below the package ("" for the root itself)."""
    rest = module[len(package) + 1 :] if module != package else ""
    return rest.split(".")[0]


def _targets(node: ast.AST, module: str, is_package: bool, root: Path, package: str) -> list[str]:
    """The package modules an import statement loads (names of ``from X import name`` that are submodules
    count as those submodules; other names as X itself)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == package or a.name.startswith(package + ".")]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        src = ".".join(base + ([node.module] if node.module else []))
    else:
        src = node.module or ""
    if src != package and not src.startswith(package + "."):
        return []
    out = []
    for alias in node.names:
        sub = f"{src}.{alias.name}"
        sub_path = root.joinpath(*sub.split(".")[1:])
        out.append(sub if sub_path.with_suffix(".py").exists() or sub_path.is_dir() else src)
    return out


def _sources(root: Path, package: str, mapped: tuple[Path, ...]) -> list[tuple[Path, str]]:
    """(file, module name) of every module of the package: those under ``root`` and those of each ``mapped``
    top-level folder, which installs as ``package.<folder name>``."""
    found = [(path, _module_name(path, root, package)) for path in sorted(root.rglob("*.py"))]
    for top in mapped:
        found += [(path, _module_name(path, top.parent, package)) for path in sorted(top.rglob("*.py"))]
    return found


def _imports_package(tree: ast.AST, package: str) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == package for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == package):
            return True
    return False


def leaf_modules(root: Path, package: str, component: str) -> set[str]:
    """The modules of ``component`` that import nothing of the package (its ``__init__`` never counts: it is the
    component's door)."""
    return {
        module
        for path, module in _sources(root, package, ())
        if _component(module, root, package) == component
        and path.name != "__init__.py"
        and not _imports_package(ast.parse(path.read_text(), filename=str(path)), package)
    }


def upward_imports(
    root: Path = ROOT,
    package: str = PACKAGE,
    layers: dict[str, float] = LAYERS,
    mapped: tuple[Path, ...] = (),
    leaf_reads: tuple[tuple[str, str], ...] = LEAF_READS,
) -> list[str]:
    """'file:line: src (layer a) imports dst (layer b)' for every import of a higher layer (but the leaf modules
    ``leaf_reads`` allows); also a line for every top-level name of the package that has no layer."""
    problems = []
    leaves = {(reader, read): leaf_modules(root, package, read) for reader, read in leaf_reads}
    for path, module in _sources(root, package, mapped):
        src = _component(module, root, package)
        if src not in layers:
            problems.append(f"{path}: {src!r} has no layer in LAYERS")
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        found = []
        for node in ast.walk(tree):
            for target in _targets(node, module, path.name == "__init__.py", root, package):
                dst = _component(target, root, package)
                if dst not in layers:
                    found.append((node.lineno, f"{path}:{node.lineno}: imports {target}, whose {dst!r} has no layer"))
                elif layers[dst] > layers[src] and target not in leaves.get((src, dst), ()):
                    found.append(
                        (
                            node.lineno,
                            f"{path.relative_to(root.parent)}:{node.lineno}: {module} (layer {layers[src]}) imports "
                            f"{target} (layer {layers[dst]})",
                        )
                    )
        problems += [text for _, text in sorted(found)]
    return problems


def backend_imports(root: Path = ROOT, package: str = PACKAGE, reader: str = "adapters") -> list[str]:
    """'file:line: module imports name' for every import, in a module of ``reader``, of a codec backend module
    (``CODEC_BACKEND_MODULES``) or of a backend name from the codec layer (``CODEC_BACKEND_NAMES``, or one
    device's form of an op: ``PER_DEVICE_SUFFIXES``)."""
    problems = []
    codecs = f"{package}.codecs"
    for path, module in _sources(root, package, ()):
        if _component(module, root, package) != reader:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            targets = _targets(node, module, path.name == "__init__.py", root, package)
            names = [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else [None] * len(targets)
            for target, name in zip(targets, names):
                if target != codecs and not target.startswith(codecs + "."):
                    continue
                last = (target if name is None or target.endswith("." + name) else f"{target}.{name}").split(".")[-1]
                if (
                    target.split(".")[-1] in CODEC_BACKEND_MODULES
                    or last in CODEC_BACKEND_MODULES
                    or last in CODEC_BACKEND_NAMES
                    or last.endswith(PER_DEVICE_SUFFIXES)
                ):
                    where = path.relative_to(root.parent)
                    problems.append(
                        f"{where}:{node.lineno}: {module} imports {target}{'' if name is None else ':' + name}"
                    )
    return problems


def test_no_import_runs_upward():
    kernel_modules = {m for _, m in _sources(ROOT, PACKAGE, MAPPED) if m.startswith(f"{PACKAGE}.kernels.cuda.")}
    assert f"{PACKAGE}.kernels.cuda.codec_kernels" in kernel_modules, kernel_modules  # the moved kernels are read
    problems = upward_imports(mapped=MAPPED)
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


def test_no_adapter_names_a_codec_backend():
    problems = backend_imports()
    assert not problems, "adapters that choose a codec backend (call the codec door instead):\n" + "\n".join(problems)


def test_the_kernels_read_leaf_spec_modules_of_the_codec_layer():
    leaves = leaf_modules(ROOT, PACKAGE, "codecs")
    assert f"{PACKAGE}.codecs.layout" in leaves and f"{PACKAGE}.codecs.rng" in leaves, leaves
    assert f"{PACKAGE}.codecs.qsgd" not in leaves and f"{PACKAGE}.codecs" not in leaves, leaves


def test_every_top_level_name_has_a_layer():
    names = {
        p.stem if p.is_file() else p.name for p in ROOT.iterdir() if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    names.discard("__init__")
    assert names <= set(LAYERS), f"give these a layer in LAYERS: {sorted(names - set(LAYERS))}"


def test_checker_sees_upward_imports_of_every_form(tmp_path):
    """The checker itself can fail: a miniature package with one upward import of each form."""
    pkg = tmp_path / PACKAGE
    for d in ("codecs", "comm", "strategies"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from lightning_qcomm.codecs import x\n")  # downward: fine
    (pkg / "strategies" / "s.py").write_text("")
    (pkg / "codecs" / "a.py").write_text(
        "import lightning_qcomm.comm\n"  # upward, absolute
        "def f():\n"
        "    from lightning_qcomm.strategies import s\n"  # upward, inside a function, a submodule
        "from lightning_qcomm import get_codec\n"  # the root re-exports everything: upward
        "from ..comm import y\n"  # upward, relative
        "from . import b\n"  # same layer
    )
    (pkg / "comm" / "c.py").write_text("from lightning_qcomm.codecs import a\n")  # downward: fine
    (tmp_path / "kernels" / "cuda").mkdir(parents=True)  # a top-level folder installed as lightning_qcomm.kernels
    (tmp_path / "kernels" / "cuda" / "k.py").write_text("from lightning_qcomm.comm import c\n")  # upward
    found = upward_imports(pkg, PACKAGE, mapped=(tmp_path / "kernels",))
    assert [p.split(": ", 1)[1] for p in found] == [
        "lightning_qcomm.codecs.a (layer 0.5) imports lightning_qcomm.comm (layer 1)",
        "lightning_qcomm.codecs.a (layer 0.5) imports lightning_qcomm.strategies.s (layer 5)",
        "lightning_qcomm.codecs.a (layer 0.5) imports lightning_qcomm (layer 5)",
        "lightning_qcomm.codecs.a (layer 0.5) imports lightning_qcomm.comm (layer 1)",
        "lightning_qcomm.kernels.cuda.k (layer 0) imports lightning_qcomm.comm.c (layer 1)",
    ], found


def test_checker_lets_the_kernels_read_only_leaf_modules_of_the_codec_layer(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "codecs").mkdir(parents=True)
    (pkg / "codecs" / "__init__.py").write_text("from lightning_qcomm.codecs.spec import K\n")
    (pkg / "codecs" / "spec.py").write_text("import math\nK = 1\n")  # a leaf: imports nothing of the package
    (pkg / "codecs" / "math_.py").write_text("from .spec import K\n")  # not a leaf (relative import)
    (tmp_path / "kernels" / "cuda").mkdir(parents=True)
    (tmp_path / "kernels" / "cuda" / "k.py").write_text(
        "from lightning_qcomm.codecs import spec\n"  # a leaf: fine
        "from lightning_qcomm.codecs.spec import K\n"  # a leaf: fine
        "from lightning_qcomm.codecs import math_\n"  # not a leaf
        "from lightning_qcomm.codecs import K\n"  # the codec layer's door: not a leaf
    )
    (pkg / "codecs" / "uses_kernels.py").write_text("from lightning_qcomm.kernels.cuda import k\n")  # down: fine
    found = upward_imports(pkg, PACKAGE, mapped=(tmp_path / "kernels",))
    assert [p.split(": ", 1)[1] for p in found] == [
        "lightning_qcomm.kernels.cuda.k (layer 0) imports lightning_qcomm.codecs.math_ (layer 0.5)",
        "lightning_qcomm.kernels.cuda.k (layer 0) imports lightning_qcomm.codecs (layer 0.5)",
    ], found


def test_checker_sees_an_adapter_naming_a_codec_backend(tmp_path):
    pkg = tmp_path / PACKAGE
    for d in ("codecs", "adapters", "collectives"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    for m in ("rows", "cpu_fused", "rows_encode"):
        (pkg / "codecs" / f"{m}.py").write_text("")
    (pkg / "adapters" / "a.py").write_text(
        "from lightning_qcomm.codecs import Codec, get_codec\n"  # the door: fine
        "from lightning_qcomm.codecs.rows import encode_rows, c_pass_available\n"  # a backend name
        "from lightning_qcomm.codecs import cpu_fused\n"  # a backend module
        "import lightning_qcomm.codecs.cpu_fused\n"  # a backend module, plain import
        "def f():\n"
        "    from lightning_qcomm.codecs.rows_encode import encode_rows_cuda\n"  # one device's form of an op
    )
    (pkg / "collectives" / "c.py").write_text("from lightning_qcomm.codecs import cpu_fused\n")  # not an adapter
    found = backend_imports(pkg, PACKAGE)
    assert [p.split(": ", 1)[1] for p in found] == [
        "lightning_qcomm.adapters.a imports lightning_qcomm.codecs.rows:c_pass_available",
        "lightning_qcomm.adapters.a imports lightning_qcomm.codecs.cpu_fused:cpu_fused",
        "lightning_qcomm.adapters.a imports lightning_qcomm.codecs.cpu_fused",
        "lightning_qcomm.adapters.a imports lightning_qcomm.codecs.rows_encode:encode_rows_cuda",
    ], found
