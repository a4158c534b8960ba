"""`python -m rl.serve MODEL_OR_CKPT [flags]`: the same as `jointrl serve`."""
import sys

from rl.serve.app import cli

if __name__ == "__main__":
    sys.exit(cli())
