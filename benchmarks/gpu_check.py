"""The GPU check: one command, one GPU, at most 8 minutes, installs nothing.

    python benchmarks/gpu_check.py            # from the repository root

1. runs ``tests/cuda`` (pytest in a subprocess, at most ``TEST_BUDGET_S``): Triton == reference bit for bit,
   beyond 2^31 elements, no host syncs, the DDP hook and QSDP comms at world 8 on the fake process group,
   kernel launches per all-reduce against the world size;
2. times every codec's encode and decode of 2^26 fp32 elements against a device-to-device copy of the same
   tensor (CUDA events, median of ``REPS``), and reports the fraction of the copy's bandwidth each reaches
   (bytes read + written per call; goal: >= 70% for uniform-8 and fp8), and whether the codec's Triton kernels
   passed their first-use check (``codecs.triton_probe``) or the torch reference ran instead, and why;
3. trains a GPT-2-small-shaped and a LLaMA-style model under every strategy and callback against DDP
   (``benchmarks/gpu_e2e.py``: median step, ratio, peak memory, kernel launches per step) in the time left;
4. writes ``benchmarks/results/gpu_check.md`` (and ``gpu_e2e.md``).

It uses the installed ``lightning_qcomm`` (an editable or a non-editable install) when there is one, else
this checkout; the Triton kernels are its ``lightning_qcomm.kernels``.
Exit status: 0 when every test passed or was skipped, 1 when one failed or the tests ran out of time, 2 when
there is no CUDA device (nothing is run, nothing is written).
"""

from __future__ import annotations

import importlib.util
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "gpu_check.md"
TEST_BUDGET_S = 240
TOTAL_BUDGET_S = 480  # the whole check; the end-to-end runs take what the tests and the codec timing leave
E2E_ORDER = "ddp,qddp_uniform8,qddp_fp8,qddp_nuqsgd4,onebit_adam,actq4,fsdp2,qsdp_w8g8,local_sgd,qddp_auto"
NUMEL = 1 << 26
REPS = 10
GOAL = 0.70
CODECS = [  # (label, name, bits, options)
    *[(f"uniform{b}", "uniform", b, {}) for b in (8, 4, 2, 1)],
    ("uniform8_nearest", "uniform", 8, {"stochastic": False}),
    *[(f"qsgd{b}", "qsgd", b, {}) for b in (8, 4, 2)],
    ("qsgdinf4", "qsgdinf", 4, {}),
    *[(f"nuqsgd{b}", "nuqsgd", b, {}) for b in (8, 4)],
    ("sign1", "sign1", 1, {}),
    ("fp8_e4m3", "fp8_e4m3", 8, {}),
    ("fp8_e4m3_stochastic", "fp8_e4m3", 8, {"rounding": "stochastic"}),
    ("fp8_e5m2", "fp8_e5m2", 8, {}),
]
GOAL_CODECS = ("uniform8", "fp8_e4m3", "fp8_e5m2")


def _package() -> tuple[str, dict[str, str]]:
    """Import lightning_qcomm (installed, else this checkout); (where it came from, env for the test subprocess)."""
    env = dict(os.environ)
    if importlib.util.find_spec("lightning_qcomm") is None:
        sys.path.insert(0, str(REPO))
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    import lightning_qcomm

    where = Path(lightning_qcomm.__file__).resolve().parent
    kind = "this checkout, not installed" if where == REPO / "lightning_qcomm" else "installed"
    import lightning_qcomm.kernels as kernels

    return f"{where} ({kind}); Triton kernels: {'yes' if kernels.HAS_TRITON else 'NO'}", env


def run_tests(env: dict[str, str]) -> dict:
    """pytest tests/cuda in a subprocess (from a temporary directory, so the checkout is not on its path)."""
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "cuda.xml"
        cmd = [sys.executable, "-m", "pytest", str(REPO / "tests" / "cuda"), "-q", "-rA", "-p", "no:cacheprovider"]
        cmd += [f"--junitxml={xml}", "-o", "junit_logging=system-out"]
        start = time.monotonic()
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=TEST_BUDGET_S)
            output, timed_out = proc.stdout + proc.stderr, False
        except subprocess.TimeoutExpired as err:
            output, timed_out = (
                (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""),
                True,
            )
        res = {"seconds": time.monotonic() - start, "timed_out": timed_out, "tail": output[-4000:], "cases": []}
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                status, detail = "passed", ""
                for tag in ("failure", "error", "skipped"):
                    node = case.find(tag)
                    if node is not None:
                        status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                        if node.get("type") == "pytest.xfail":
                            status = "xfailed"
                        detail = (node.get("message") or "").splitlines()[0][:200] if node.get("message") else ""
                out = case.findtext("system-out") or ""
                res["cases"].append((f"{case.get('classname')}::{case.get('name')}", status, detail, out))
    return res


def time_codecs() -> tuple[float, list[tuple[str, float, float, float, float, str]]]:
    """(copy bandwidth GB/s, [(label, encode ms, decode ms, encode fraction, decode fraction, kernels)]); kernels:
    "Triton", or "torch reference (<why>)" where the codec's first-use check failed."""
    import torch

    from lightning_qcomm.codecs import cuda, get_codec, triton_probe

    x = torch.randn(NUMEL, device="cuda")
    y = torch.empty_like(x)

    def median_ms(fn) -> float:
        for _ in range(2):
            fn()
        times = []
        for _ in range(REPS):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        return statistics.median(times)

    copy_ms = median_ms(lambda: y.copy_(x))
    copy_bw = 2 * 4 * NUMEL / (copy_ms * 1e-3)
    rows = []
    for label, name, bits, opts in CODECS:
        codec = get_codec(name, bits=bits, **opts)
        packed = codec.encode(x, seed=1)
        enc_ms = median_ms(lambda codec=codec: codec.encode(x, seed=1))
        dec_ms = median_ms(lambda codec=codec, packed=packed: codec.decode(packed))
        moved = 4 * NUMEL + packed.nbytes  # fp32 in, payload out (encode); payload in, fp32 out (decode)
        used = cuda.triton_for(codec, x.device)  # installed, not disabled, and its first-use check passed
        why = triton_probe.failure(codec, x.device) or "Triton not installed or disabled"
        kernels = "Triton" if used else f"torch reference ({why})"
        enc_f, dec_f = moved / (enc_ms * 1e-3) / copy_bw, moved / (dec_ms * 1e-3) / copy_bw
        rows.append((label, enc_ms, dec_ms, enc_f, dec_f, kernels))
    return copy_bw / 1e9, rows


def write_report(where: str, tests: dict, copy_gbs: float, rows: list, total_s: float) -> str:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    counts: dict[str, int] = {}
    for _, status, _, _ in tests["cases"]:
        counts[status] = counts.get(status, 0) + 1
    lines = [
        "# GPU check",
        "",
        f"Command: `python benchmarks/gpu_check.py` ({total_s / 60:.1f} min). Device: {torch.cuda.get_device_name()};",
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, Triton {triton_version}, Python {platform.python_version()}.",
        f"lightning_qcomm: {where}.",
        "",
        "## tests/cuda",
        "",
        f"{', '.join(f'{v} {k}' for k, v in sorted(counts.items())) or 'no results'} in {tests['seconds']:.0f} s"
        + (" -- TIMED OUT" if tests["timed_out"] else "")
        + ".",
        "",
    ]
    bad = [(n, s, d) for n, s, d, _ in tests["cases"] if s in ("failed", "error")]
    if bad:
        lines += ["| failed | message |", "|---|---|"] + [f"| `{n}` | {d} |" for n, s, d in bad] + [""]
    notes = [(n, s, d) for n, s, d, _ in tests["cases"] if s in ("skipped", "xfailed")]
    if notes:
        lines += ["| skipped / expected failure | reason |", "|---|---|"]
        lines += [f"| `{n}` ({s}) | {d} |" for n, s, d in notes] + [""]
    printed = [m for _, _, _, out in tests["cases"] for m in re.findall(r"kernel launches per .*", out)]
    if printed:
        lines += (
            ["Kernel launches (CUDA runtime/driver launch calls per call):", ""] + [f"- {m}" for m in printed] + [""]
        )
    if not tests["cases"]:
        lines += ["```", tests["tail"], "```", ""]
    lines += [
        "## Codec throughput",
        "",
        f"2^26 fp32 elements (256 MiB), median of {REPS}. Device-to-device copy: {copy_gbs:.0f} GB/s (read + write).",
        f"Fraction = (fp32 bytes + payload bytes) per call / time, over the copy's bandwidth; goal >= {GOAL:.0%} for",
        "uniform-8 and fp8.",
        "",
        "| codec | encode ms | decode ms | encode fraction | decode fraction | goal | kernels |",
        "|---|---:|---:|---:|---:|---|---|",
    ]
    for label, enc_ms, dec_ms, enc_f, dec_f, kernels in rows:
        goal = ("met" if min(enc_f, dec_f) >= GOAL else "NOT met") if label in GOAL_CODECS else ""
        kernels = kernels.replace("|", "/")
        lines.append(f"| {label} | {enc_ms:.3f} | {dec_ms:.3f} | {enc_f:.0%} | {dec_f:.0%} | {goal} | {kernels} |")
    text = "\n".join(lines) + "\n"
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(text)
    return text


def main() -> int:
    start = time.monotonic()
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device is visible (torch.cuda.is_available() is False); nothing was run and "
            f"{RESULTS.relative_to(REPO)} was not written. Run this on a machine with an NVIDIA GPU.",
            file=sys.stderr,
        )
        return 2
    where, env = _package()
    print(f"gpu_check: {torch.cuda.get_device_name()}; lightning_qcomm from {where}", flush=True)
    tests = run_tests(env)
    failed = tests["timed_out"] or any(s in ("failed", "error") for _, s, _, _ in tests["cases"]) or not tests["cases"]
    print(f"gpu_check: tests/cuda done in {tests['seconds']:.0f} s ({'FAILED' if failed else 'ok'})", flush=True)
    copy_gbs, rows = time_codecs()
    sys.path.insert(0, str(REPO))
    from benchmarks import gpu_e2e

    left = TOTAL_BUDGET_S - (time.monotonic() - start) - 20
    e2e = gpu_e2e.main(["--methods", E2E_ORDER, "--budget-s", f"{max(left, 0):.0f}"])
    failed = failed or any("error" in r and "budget" not in r["error"] for r in e2e)
    text = write_report(where, tests, copy_gbs, rows, time.monotonic() - start)
    text += "\n" + (REPO / "benchmarks" / "results" / "gpu_e2e.md").read_text()
    RESULTS.write_text(text)
    print(text)
    print(f"gpu_check: wrote {RESULTS}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
