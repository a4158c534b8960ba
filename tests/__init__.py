"""The test suite. Its folders mirror the source tree (tests/<package>/<module>); test-only
builders live beside the tests that use them, never in the installed packages."""
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
