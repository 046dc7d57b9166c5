"""``python -m benchmarks ARGS`` is ``hftc bench ARGS``."""

import sys

from hftc.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
