"""``python -m benchmarks.netbench ...`` (from the repository root): see ``benchmarks.netbench.cli``."""

import sys

from benchmarks.netbench.cli import main

sys.exit(main())
