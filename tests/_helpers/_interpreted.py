"""Run a test file as a script under Triton's interpreter and return the JSON report it prints last.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` decorates a kernel, i.e. when ``lightning_qcomm.kernels`` is
first imported, which the rest of the suite may already have done in this process; so the kernel tests run their
cases in a fresh process with the variable set (one thread, Triton not switched off) and assert on its report.

The worker runs with ``patch_lang_once_per_launch``: Triton's interpreter patches ``triton.language`` for the
interpreter (``_patch_lang``) at every launch and again at every call of a ``@triton.jit`` helper inside it, i.e.
once per program per helper call; within one launch every such call after a helper's first sets the attributes
the first already set (the launch restores them all when it ends); skipping those took 15-25% off the interpreted
test files. The kernels run the same interpreted operations either way.

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
    "import _interpreted; _interpreted.patch_lang_once_per_launch(); "
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


def run_interpreted(script: str, timeout_s: float) -> dict:
    """``python script`` with ``TRITON_INTERPRET=1`` (and ``patch_lang_once_per_launch``); its last stdout line
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
