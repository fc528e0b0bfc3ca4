"""The device kernels live in the repository's top-level ``kernels/`` and install as ``lightning_qcomm.kernels``.

    kernels/cuda/     the Triton kernels (codec_kernels.py, elementwise.py, reduce_kernels.py, wire_params.py)
    kernels/cpu/      the C++ sources of the CPU kernels (qcomm_ops.cpp, qcomm_kernels.h)
    lightning_qcomm/kernels/__init__.py   the facade, the only file left there

``kernels/`` has no ``__init__.py``: with the repository root on ``sys.path`` (``python -m pytest`` or
``python benchmarks/gpu_check.py`` from the root) a regular package there would shadow PyPI's ``kernels``
(Hugging Face's), and ``transformers`` then fails to import its models. A source checkout (editable or not
installed) reaches ``kernels/`` through the facade's ``__path__``; a wheel holds it under
``lightning_qcomm/kernels/`` (tests/cli/test_cli_configs.py builds one).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_qcomm.kernels as kernels

REPO = Path(__file__).resolve().parents[2]
CUDA = (
    "codec_kernels.py",
    "elementwise.py",
    "norms.py",
    "reduce_kernels.py",
    "rotation_kernels.py",
    "rounding_kernels.py",
    "segment_kernels.py",
    "wire_params.py",
)
CPU = ("qcomm_ops.cpp", "qcomm_kernels.h")


def test_the_kernels_are_in_the_top_level_folder_and_nowhere_else():
    top = REPO / "kernels"
    assert {p.name for p in (top / "cuda").glob("*.py")} == {"__init__.py", *CUDA}
    assert {p.name for p in (top / "cpu").iterdir() if p.name != "__pycache__"} == set(CPU)
    assert not (top / "__init__.py").exists()  # a namespace portion, never a package named `kernels`
    assert not (REPO / "lightning_qcomm" / "csrc").exists()
    left = {p.name for p in (REPO / "lightning_qcomm" / "kernels").iterdir() if p.name != "__pycache__"}
    assert left == {"__init__.py"}, left


def test_the_facade_reaches_the_top_level_folder():
    assert Path(kernels.__file__).parent == REPO / "lightning_qcomm" / "kernels"
    assert [Path(p) for p in kernels.__path__] == [REPO / "lightning_qcomm" / "kernels", REPO / "kernels"]
    names = {
        "HAS_TRITON",
        "decode",
        "decode_codec",
        "decode_rows",
        "encode",
        "encode_codec",
        "encode_rows",
        "encode_rows_codec",
        "fused_scales",
        "wire_encode_params",
    }
    assert names <= set(kernels.__all__) and all(hasattr(kernels, n) for n in names)
    from lightning_qcomm.codecs import native

    assert Path(native.CSRC) == REPO / "kernels" / "cpu"


def test_attribute_access_is_the_module_the_ops_read():
    pytest.importorskip("triton")
    from lightning_qcomm.kernels.cuda import codec_kernels, wire_params

    assert kernels.HAS_TRITON
    assert kernels.codec_kernels is codec_kernels and kernels.wire_params is wire_params
    assert kernels.encode is codec_kernels.encode and kernels.wire_encode_params is wire_params.wire_encode_params
    assert Path(codec_kernels.__file__) == REPO / "kernels" / "cuda" / "codec_kernels.py"


def test_the_repository_root_does_not_shadow_pypi_kernels():
    """From the repository root, ``kernels`` is not ours, and transformers builds a GPT-2 from its config."""
    pytest.importorskip("transformers")
    probe = (
        "import importlib.util, sys\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(spec is None or spec.origin is None or 'site-packages' in spec.origin)\n"
        "from transformers import GPT2Config, GPT2LMHeadModel\n"
        "GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16))\n"
        "import lightning_qcomm.kernels\n"
        "print(lightning_qcomm.kernels.__path__[-1])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:2] == ["True", str(REPO / "kernels")], out.stdout
    assert importlib.util.find_spec("lightning_qcomm.kernels.cuda") is not None
