"""``python -m cct <command> [flags]`` — the same as the ``cct`` console script."""
import sys

from cct.cli import main

if __name__ == "__main__":
    sys.exit(main())
