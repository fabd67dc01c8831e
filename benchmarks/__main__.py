"""``python -m benchmarks [--only NAME ...] [--size tiny|small] [--repeats N] --out DIR``
(from the repository root; ``make bench``): see :mod:`benchmarks.driver`."""

import sys

from .driver import main

if __name__ == "__main__":
    sys.exit(main())
