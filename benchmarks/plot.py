"""Loss vs cumulative bytes sent, one curve per run, from CSVLogger ``metrics.csv`` files (needs matplotlib).

Each run is a ``metrics.csv`` written by Lightning's ``CSVLogger`` with ``CommVolumeLogger`` in the callbacks
(e.g. the runs of ``lightning-qcomm fit --config configs/<name>.yaml``). The x value of a loss row at step s is
``comm/cum_bytes_sent`` (rank 0's wire bytes since fit start, as logged) interpolated linearly at step s between
the logged steps; with ``--baseline`` the same loss is also drawn against ``comm/cum_baseline_bytes`` (what
uncompressed fp32 would have sent), dashed.

    python benchmarks/plot.py runs/*/version_0/metrics.csv -o benchmarks/results/loss_vs_bytes.png
    python benchmarks/plot.py ddp=runs/quickstart/version_0/metrics.csv qsdp=runs/qsdp_w8g8/version_0/metrics.csv

A run's label is ``LABEL=`` before the path, else the logger's run name (the folder above ``version_*``).
"""

from __future__ import annotations

import argparse
import csv
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

BYTES_KEY = "comm/cum_bytes_sent"
BASELINE_KEY = "comm/cum_baseline_bytes"


@dataclass
class Curve:
    label: str
    bytes_sent: list[float]
    baseline: list[float]
    loss: list[float]


def _interp(x: float, xs: list[float], ys: list[float]) -> float | None:
    """Linear interpolation of ys at x (xs ascending); None outside [xs[0], xs[-1]]."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    i = bisect_left(xs, x)
    if xs[i] == x:
        return ys[i]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def read_curve(path: Path, label: str, loss_key: str) -> Curve:
    """Loss rows of one metrics.csv placed at the interpolated cumulative bytes of their step."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    comm = sorted((float(r["step"]), float(r[BYTES_KEY]), float(r[BASELINE_KEY])) for r in rows if r.get(BYTES_KEY))
    if not comm:
        raise ValueError(f"{path} has no {BYTES_KEY} column values: was CommVolumeLogger in the callbacks?")
    steps = [0.0] + [c[0] + 1 for c in comm]  # a row logged at step index s covers s + 1 optimizer steps
    sent = [0.0] + [c[1] for c in comm]
    base = [0.0] + [c[2] for c in comm]
    curve = Curve(label, [], [], [])
    for r in rows:
        if not r.get(loss_key):
            continue
        s = float(r["step"]) + 1
        x, b = _interp(s, steps, sent), _interp(s, steps, base)
        if x is not None:
            curve.bytes_sent.append(x)
            curve.baseline.append(b)
            curve.loss.append(float(r[loss_key]))
    if not curve.loss:
        raise ValueError(f"{path}: no {loss_key!r} row falls inside the logged byte range")
    return curve


def _label_and_path(arg: str) -> tuple[str, Path]:
    if "=" in arg:
        label, path = arg.split("=", 1)
        return label, Path(path)
    path = Path(arg)
    parent = path.parent
    return (parent.parent.name if parent.name.startswith("version_") else parent.name), path


def plot(curves: list[Curve], out: Path, loss_key: str, baseline: bool, logx: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in curves:
        (line,) = ax.plot([b / 1e6 for b in c.bytes_sent], c.loss, label=c.label)
        if baseline:
            ax.plot(
                [b / 1e6 for b in c.baseline],
                c.loss,
                linestyle="--",
                color=line.get_color(),
                alpha=0.6,
                label=f"{c.label} (fp32 bytes)",
            )
    ax.set_xlabel("cumulative MB sent by rank 0 (wire estimate)")
    ax.set_ylabel(loss_key)
    if logx:
        ax.set_xscale("log")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(f"{loss_key} vs communication")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="[LABEL=]path/to/metrics.csv")
    parser.add_argument("-o", "--out", default="loss_vs_bytes.png")
    parser.add_argument("--loss", default="train_loss", help="loss column (train_loss, val_loss, ...)")
    parser.add_argument("--baseline", action="store_true", help="also draw each loss against its fp32 baseline bytes")
    parser.add_argument("--logx", action="store_true")
    args = parser.parse_args(argv)
    curves = [read_curve(path, label, args.loss) for label, path in map(_label_and_path, args.runs)]
    plot(curves, Path(args.out), args.loss, args.baseline, args.logx)
    for c in curves:
        print(
            f"{c.label}: {len(c.loss)} points, final {args.loss} {c.loss[-1]:.4f} at {c.bytes_sent[-1] / 1e6:.2f} MB sent"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
