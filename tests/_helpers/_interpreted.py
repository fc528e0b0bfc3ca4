"""Run a test file as a script under Triton's interpreter and return the JSON report it prints last.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when ``lightning_qcomm.kernels`` is
first imported, which the rest of the suite may already have done in this process; so the kernel tests run their
cases in a fresh process with the variable set (one thread, Triton not switched off) and assert on its report.

The worker runs with ``patch_lang_once_per_launch``: Triton's interpreter patches ``triton.language`` for the
interpreter (``_patch_lang``) at every launch and again at every call of a ``@triton.jit`` helper inside it, i.e.
once per program per helper call; within one launch every such call after a helper's first sets the attributes
the first already set (the launch restores them all when it ends); skipping those took 15-25% off the interpreted
test files. The kernels run the same interpreted operations either way. It also keeps the numpy dtype of each
Triton type (``cache_np_dtypes``) instead of building the interpreter's table at every operation, and unwraps
constexprs of the common exact types without the generic checks (``unwrap_plain_values_first``), and does not
compute the integer overflow checks that ``device_assert`` drops without ``debug`` (``skip_discarded_overflow_checks``).

Example::

    report = run_interpreted(__file__, 600)  # the file's ``__main__`` block prints json.dumps(cases)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_BOOT = (
    "import os, runpy, sys; script = sys.argv[1]; sys.argv = sys.argv[1:]; "
    "sys.path[0] = os.path.dirname(script); sys.path.insert(1, {helpers!r}); "
    "import _interpreted; _interpreted.patch_lang_once_per_launch(); _interpreted.cache_np_dtypes(); "
    "_interpreted.unwrap_plain_values_first(); _interpreted.skip_discarded_overflow_checks(); "
    "runpy.run_path(script, run_name='__main__')"
)


class _Unpatched:
    """The scope of a skipped patch: nothing to restore."""

    @staticmethod
    def restore() -> None:
        pass


def patch_lang_once_per_launch() -> bool:
    """Within one interpreted launch, ``triton.runtime.interpreter._patch_lang(fn)`` runs once per ``fn`` (the
    kernel, then each helper at its first call); a later call for the same ``fn`` in that launch is skipped. False
    (nothing changed) where this Triton has no such interpreter."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch is None or executor is None or getattr(patch, "once_per_launch", False):
        return False
    launch_call = executor.__call__
    seen: list[set] = []  # the functions patched for, one set per launch in progress

    def call(self, *args, **kwargs):
        seen.append(set())
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            seen.pop()

    def patch_once(fn):
        if seen:
            if fn in seen[-1]:
                return _Unpatched
            seen[-1].add(fn)
        return patch(fn)

    patch_once.once_per_launch = True
    executor.__call__ = call
    interpreter._patch_lang = patch_once
    return True


def cache_np_dtypes() -> bool:
    """``triton.runtime.interpreter._get_np_dtype(t)`` (the numpy dtype holding a Triton type's values; called at
    nearly every interpreted operation) builds its table of 19 types at each call, ~10% of an interpreted kernel's
    time; here its value is kept per scalar or pointer type (a block type's is its element type's, as there).
    False (nothing changed) where this Triton has no such function."""
    try:
        from triton import language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    get = getattr(interpreter, "_get_np_dtype", None)
    if get is None or getattr(get, "cached", False):
        return False
    cache: dict = {}

    def get_cached(tt_dtype):
        ty = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        key = (type(ty), ty.name)
        found = cache.get(key)
        if found is None:
            found = cache[key] = get(ty)
        return found

    get_cached.cached = True
    interpreter._get_np_dtype = get_cached
    return True


def unwrap_plain_values_first() -> bool:
    """``triton.language.core._unwrap_if_constexpr(o)`` (a constexpr's value, lists and tuples unwrapped element by
    element, anything else as it is; called about a million times a minute of interpreted kernels) answers for
    values whose exact type is a constexpr, a tensor, a Triton type or a Python scalar without its chain of
    ``isinstance`` checks, and calls the original for every other value. False (nothing changed) where this Triton
    has no such function."""
    try:
        from triton.language import core
    except ImportError:
        return False
    unwrap = getattr(core, "_unwrap_if_constexpr", None)
    if unwrap is None or getattr(unwrap, "plain_first", False):
        return False
    constexpr = core.constexpr
    as_is = {int, float, bool, str, type(None), core.tensor, core.dtype, core.pointer_type, core.block_type}

    def unwrap_fast(o):
        t = type(o)
        if t is constexpr:
            return o.value
        if t in as_is:
            return o
        return unwrap(o)

    unwrap_fast.plain_first = True
    core._unwrap_if_constexpr = unwrap_fast
    return True


def skip_discarded_overflow_checks() -> bool:
    """Triton's ``binary_op_sanitize_overflow_impl`` redoes every 32-bit integer add, sub and mul in 64 bits and
    hands the range check to ``device_assert``, which drops it unless the kernel runs with ``debug`` (the
    interpreter's default is off, as a GPU's); interpreted, those extra operations are about a third of a kernel's
    time. Without ``debug`` the check now keeps only its operand-type asserts. False (nothing changed) where this
    Triton has no such method or its ``device_assert`` is not the one that drops the check without ``debug``."""
    import inspect

    try:
        from triton.language import semantic
    except ImportError:
        return False
    cls = getattr(semantic, "TritonSemantic", None)
    check = getattr(cls, "binary_op_sanitize_overflow_impl", None)
    if check is None or getattr(check, "skips_discarded", False):
        return False
    try:
        dropped = "if not self.builder.options.debug:\n            return" in inspect.getsource(cls.device_assert)
    except (OSError, TypeError, AttributeError):
        dropped = False
    if not dropped:
        return False

    def check_if_asserted(self, lhs, rhs, binary_op):
        options = self.builder.options
        if options.debug:
            return check(self, lhs, rhs, binary_op)
        if lhs.type.scalar.int_bitwidth >= 64 or not options.sanitize_overflow:
            return None
        lhs_sca_ty, rhs_sca_ty = lhs.type.scalar, rhs.type.scalar
        assert lhs_sca_ty == rhs_sca_ty, f"expected matching operand types, got {lhs_sca_ty} and {rhs_sca_ty}"
        assert lhs_sca_ty.is_int(), f"expected integer type, got {lhs_sca_ty}"
        return None  # the 64-bit redo and its check: dropped by device_assert without debug

    check_if_asserted.skips_discarded = True
    cls.binary_op_sanitize_overflow_impl = check_if_asserted
    return True


def run_interpreted(script: str, timeout_s: float) -> dict:
    """``python script`` with ``TRITON_INTERPRET=1`` (and the patches above); its last stdout line
    parsed as JSON. AssertionError with the output's tail when it fails."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env.pop("LIGHTNING_QCOMM_DISABLE_TRITON", None)
    boot = _BOOT.format(helpers=os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-c", boot, os.path.abspath(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, f"interpreted worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_kind_passed(report: dict, kind: str) -> None:
    """Every case of ``report`` named ``<kind>_...`` is true, and there is at least one (the failing names shown)."""
    cases = {k: v for k, v in report.items() if k.startswith(kind + "_")}
    assert cases, kind
    assert all(cases.values()), [k for k, v in cases.items() if not v]
