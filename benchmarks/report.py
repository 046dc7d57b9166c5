"""``python -m benchmarks.report RESULTS.json ...`` is ``python -m hftc.bench.report``."""

import sys

from hftc.bench.report import main

if __name__ == "__main__":
    sys.exit(main())
