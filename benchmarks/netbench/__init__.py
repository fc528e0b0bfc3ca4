"""netbench: every compression method side by side on a real, rate-limited network.

Run from the repository root: ``sudo python -m benchmarks.netbench --rates 100,1000 ...`` (see ``cli`` and
BENCHMARKS.md §1). Modules: ``cli`` (command line, report writing), ``net`` (shaped namespaces or
loopback), ``orchestrate`` (schedule, worker pairs), ``variants`` (what each row trains with),
``worker`` (one rank's measurement), ``report`` (tables and plot).
"""

from benchmarks.netbench.build import variant_available
from benchmarks.netbench.cli import main, parse_args
from benchmarks.netbench.net import LoopbackNet, NamespaceNet, make_net
from benchmarks.netbench.orchestrate import make_schedule, run_schedule
from benchmarks.netbench.report import aggregate
from benchmarks.netbench.variants import VARIANT_BY_NAME, VARIANTS

__all__ = [
    "VARIANTS",
    "VARIANT_BY_NAME",
    "LoopbackNet",
    "NamespaceNet",
    "aggregate",
    "main",
    "make_net",
    "make_schedule",
    "parse_args",
    "run_schedule",
    "variant_available",
]
