"""`python -m spruce ...`: the `spruce` command line."""

import sys

from spruce.cli import main

if __name__ == "__main__":
    sys.exit(main())
