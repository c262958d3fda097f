"""End-to-end bench (ANCHORS.md protocol): the same code as `chronicals bench`.

    PYTHONPATH=src python benchmarks/bench_e2e.py --quick --out benchmarks/results
    PYTHONPATH=src python benchmarks/bench_e2e.py --device cpu --tiny --out /tmp/bench   # harness check, no GPU

Every flag of `chronicals bench --help` applies. Workers run as `python -m chronicals.bench.worker`, so
the package must be importable (PYTHONPATH=src or an installed checkout).
"""

import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
if SRC.is_dir() and str(SRC) not in sys.path:
    sys.path.insert(0, str(SRC))

from chronicals.bench import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
