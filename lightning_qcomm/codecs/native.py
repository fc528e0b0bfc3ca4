"""Build, cache and load the CPU kernels of the ``qcomm`` ops (the repository's ``kernels/cpu``).

``kernels/cpu/qcomm_ops.cpp`` (with the C kernels of ``kernels/cpu/qcomm_kernels.h``) is compiled once per machine with the
system C++ compiler (``$CXX``, else ``c++``/``g++``) against torch's stable C ABI, into a shared library that
``torch.ops.load_library`` loads: its static initialisers register the CPU kernels of the ops that
``codecs.ops`` and ``codecs.sign_ops`` define, and from then on torch's dispatcher runs them for CPU tensors.

Flags: ``-ffp-contract=off`` and no fast-math, so every fp32 operation is the torch reference's (no FMA
contraction, no reassociation); ``-march=native`` when the compiler accepts it, else the baseline ISA.

Cache: under torch's extensions dir (``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), in
``CACHE_SUBDIR``, keyed by a hash of the sources, compiler, flags, torch version and CPU. A cache directory or
library another user could have written (not owned by this user or root, group/world-writable, a symlink) is
refused with a warning, as ssh refuses a writable ``~/.ssh``; the library is then built into a private
temporary directory. Builds publish atomically (compile in a private directory, then rename).

``load()`` builds on first use; if that fails (no compiler, say) it returns None, ``load_error()`` says why,
and the caller (``cpu_fused.use_fused``) logs it once and keeps the torch reference.

Example::

    >>> path = load()            # a few seconds the first time on a machine, then cached
    >>> path is None or torch._C._dispatch_has_kernel_for_dispatch_key("qcomm::sign_decode", "CPU")
    True
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading

import torch

from lightning_qcomm.codecs.layout import c_kind_defines

log = logging.getLogger(__name__)


def _sources_dir() -> str:
    """The C++ sources: ``lightning_qcomm/kernels/cpu`` in an installed wheel, else the source checkout's
    top-level ``kernels/cpu`` (editable or not installed); the first that holds ``qcomm_ops.cpp``."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    candidates = [os.path.join(root, "kernels", "cpu") for root in (package, os.path.dirname(package))]
    return next((d for d in candidates if os.path.isfile(os.path.join(d, "qcomm_ops.cpp"))), candidates[0])


CSRC = _sources_dir()
SOURCES = ("qcomm_ops.cpp", "qcomm_kernels.h")  # compiled: the first; the rest are included
CACHE_SUBDIR = "lightning_qcomm_ops"

# No fast-math, no FMA contraction: every fp32 op is the reference's. -fno-trapping-math only lets the
# compiler if-convert (and so vectorize) branches on float compares; it changes no result.
CXXFLAGS = (
    "-O3",
    "-std=c++17",
    "-fPIC",
    "-shared",
    "-fno-fast-math",
    "-ffp-contract=off",
    "-fno-trapping-math",
    "-fno-strict-aliasing",
)

# Tried first: vectorize for this machine's ISA (its gain: BENCHMARKS.md §2). The cached
# library's key includes a fingerprint of the CPU, so a build for one CPU is never loaded on another; if
# the compiler rejects the flag, the build is redone with CXXFLAGS alone.
NATIVE_FLAGS = ("-march=native",)

ENV_SWITCH = "LIGHTNING_QCOMM_CPU_FUSED"  # "0" switches the compiled CPU kernels off
_lock = threading.Lock()
_lib: str | None = None  # path of the loaded library
_load_error: str | None = None


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _build_dir() -> str:
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


def _cpu_fingerprint() -> str:
    """What ``-march=native`` depends on: the CPU model and ISA flags (Linux), else the platform's words."""
    try:
        with open("/proc/cpuinfo") as f:
            return "".join(sorted({ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))}))
    except OSError:
        return f"{platform.machine()} {platform.processor()} {platform.platform()}"


def _torch_flags() -> tuple[str, ...]:
    """Include and link flags of the installed torch (headers of the stable ABI; libtorch_cpu, libc10)."""
    from torch.utils.cpp_extension import include_paths

    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    return (
        *c_kind_defines(),
        *(f"-I{p}" for p in include_paths()),
        f"-L{libdir}",
        "-ltorch_cpu",
        "-lc10",
        f"-Wl,-rpath,{libdir}",
    )


def _source_text() -> str:
    parts = []
    for name in SOURCES:
        with open(os.path.join(CSRC, name)) as f:
            parts.append(f.read())
    return "\0".join(parts)


def library_path(build_dir: str, cxx: str, flags: tuple[str, ...], machine: str) -> str:
    """Where the library built from these sources with ``cxx``, ``flags`` for ``machine`` is cached."""
    parts = [_source_text(), cxx, *flags, *_torch_flags(), torch.__version__, machine]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return os.path.join(build_dir, CACHE_SUBDIR, f"qcomm_ops_{key}.so")


def _unsafe(path: str, ancestor: bool = False) -> str | None:
    """Why code loaded from ``path`` could have been written by someone else, or None (ssh's StrictModes rule).

    ``path`` must be owned by this user or root and not writable by group or others, and must not be a
    symbolic link. An ``ancestor`` directory may be group/world-writable only with the sticky bit (``/tmp``).
    """
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) and not ancestor:
        return f"{path} is a symbolic link"
    if st.st_uid not in (os.geteuid(), 0):
        return f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()}) or root"
    writable = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if writable and not (ancestor and st.st_mode & stat.S_ISVTX):
        return (
            f"{path} is writable by {'group' if st.st_mode & stat.S_IWGRP else 'others'} (mode {st.st_mode & 0o7777:o})"
        )
    return None


def _unsafe_cache_dir(d: str) -> str | None:
    """``_unsafe`` for the cache directory and its build root, and the sticky rule for every ancestor."""
    d = os.path.abspath(d)
    for path in (d, os.path.dirname(d)):
        if os.path.lexists(path) and (reason := _unsafe(path)):
            return reason
    parent = os.path.dirname(os.path.dirname(d))
    while True:
        if os.path.lexists(parent) and (reason := _unsafe(os.path.realpath(parent), ancestor=True)):
            return reason
        if parent == os.path.dirname(parent):
            return None
        parent = os.path.dirname(parent)


def _compile_into(d: str, cxx: str, flags: tuple[str, ...], so: str) -> None:
    """Compile into a private temporary directory inside ``d``, then rename onto ``so`` (atomic: concurrent
    builders each publish a complete file; nobody sees a half-written library)."""
    with tempfile.TemporaryDirectory(dir=d) as tmp:  # mode 0700
        for name in SOURCES:  # compile the copy that was hashed, not files that may change meanwhile
            shutil.copyfile(os.path.join(CSRC, name), os.path.join(tmp, name))
        out = os.path.join(tmp, "qcomm_ops.so")
        cmd = [cxx, *flags, os.path.join(tmp, SOURCES[0]), "-o", out, *_torch_flags()]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"{cxx} failed: {res.stderr.strip()[-2000:]}")
        os.chmod(out, 0o755)  # whatever the umask: never group/world-writable
        os.replace(out, so)


def _build_with(cxx: str, flags: tuple[str, ...], machine: str) -> str:
    so = library_path(_build_dir(), cxx, flags, machine)
    d = os.path.dirname(so)
    os.makedirs(d, mode=0o700, exist_ok=True)
    reason = _unsafe_cache_dir(d)
    if reason is not None:  # a shared or writable cache: build privately, cache nothing
        log.warning(
            "lightning_qcomm: refusing the compiled-codec cache %s (%s); building into a private temporary "
            "directory instead (not cached)",
            d,
            reason,
        )
        private = tempfile.mkdtemp(prefix="lightning_qcomm_ops_")
        try:
            so = os.path.join(private, "qcomm_ops.so")
            _compile_into(private, cxx, flags, so)
            torch.ops.load_library(so)
            return so
        finally:
            shutil.rmtree(private, ignore_errors=True)  # the loaded library stays mapped
    if os.path.lexists(so) and (reason := _unsafe(so)):
        log.warning("lightning_qcomm: refusing the cached library %s (%s); rebuilding it", so, reason)
        os.remove(so)
    if not os.path.exists(so):
        _compile_into(d, cxx, flags, so)
    if reason := _unsafe(so):  # re-checked right before loading
        raise RuntimeError(f"refusing to load {so}: {reason}")
    torch.ops.load_library(so)
    return so


def _build() -> str:
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++)")
    try:
        return _build_with(cxx, (*CXXFLAGS, *NATIVE_FLAGS), _cpu_fingerprint())
    except RuntimeError as e:
        log.info("lightning_qcomm: native build of the CPU kernels failed (%s); building for the baseline ISA", e)
        return _build_with(cxx, CXXFLAGS, "")


def load() -> str | None:
    """Path of the loaded library (built on first use), or None if it cannot be built or loaded; the reason
    is in ``load_error()`` and the caller logs it once."""
    global _lib, _load_error
    if _lib is None and _load_error is None:
        with _lock:
            if _lib is None and _load_error is None:
                try:
                    _lib = _build()
                except Exception as e:  # any build/load failure -> reference path, reported by the caller
                    _load_error = f"{type(e).__name__}: {e}"
    return _lib


def load_error() -> str | None:
    return _load_error
