"""The layer order holds: no module of lightning_qcomm imports from a layer above its own. The layers and the file
map are in docs/design.md, "Layers and files"; ``LAYERS`` below is their machine form (the top-level ``kernels/``
installs as ``lightning_qcomm.kernels``).

Imports within one layer are free. Every import counts, also those inside functions and under
``TYPE_CHECKING``. Read with ``ast``, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "lightning_qcomm"
REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / PACKAGE
# top-level folders of the repository that install inside the package (pyproject.toml's package-dir)
MAPPED = (REPO / "kernels",)  # lightning_qcomm.kernels.cuda, ...

LAYERS = {
    "_checks": 0,
    "_log": 0,
    "codecs": 0,
    "kernels": 0,
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


def upward_imports(
    root: Path = ROOT, package: str = PACKAGE, layers: dict[str, int] = LAYERS, mapped: tuple[Path, ...] = ()
) -> list[str]:
    """'file:line: src (layer a) imports dst (layer b)' for every import of a higher layer; also a line for
    every top-level name of the package that has no layer."""
    problems = []
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
                elif layers[dst] > layers[src]:
                    found.append(
                        (
                            node.lineno,
                            f"{path.relative_to(root.parent)}:{node.lineno}: {module} (layer {layers[src]}) imports "
                            f"{target} (layer {layers[dst]})",
                        )
                    )
        problems += [text for _, text in sorted(found)]
    return problems


def test_no_import_runs_upward():
    kernel_modules = {m for _, m in _sources(ROOT, PACKAGE, MAPPED) if m.startswith(f"{PACKAGE}.kernels.cuda.")}
    assert f"{PACKAGE}.kernels.cuda.codec_kernels" in kernel_modules, kernel_modules  # the moved kernels are read
    problems = upward_imports(mapped=MAPPED)
    assert not problems, "imports against the layer order:\n" + "\n".join(problems)


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
        "lightning_qcomm.codecs.a (layer 0) imports lightning_qcomm.comm (layer 1)",
        "lightning_qcomm.codecs.a (layer 0) imports lightning_qcomm.strategies.s (layer 5)",
        "lightning_qcomm.codecs.a (layer 0) imports lightning_qcomm (layer 5)",
        "lightning_qcomm.codecs.a (layer 0) imports lightning_qcomm.comm (layer 1)",
        "lightning_qcomm.kernels.cuda.k (layer 0) imports lightning_qcomm.comm.c (layer 1)",
    ], found
