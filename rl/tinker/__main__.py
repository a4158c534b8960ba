"""`python -m rl.tinker serve MODEL ...`: the same as `jointrl tinker serve`."""
import sys

from rl.tinker.app import main

if __name__ == "__main__":
    sys.exit(main())
