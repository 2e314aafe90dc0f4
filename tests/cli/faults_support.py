"""Shared by the fault scripts in tests/cli (test_cli_faults.py, test_tools_faults.py):
pass/fail bookkeeping, a scratch directory unique to the run, the models directory.

The scripts run as plain programs (`python3 tests/cli/test_x.py ...`), so this module is
found through sys.path[0], the scripts' own directory.
"""
import os
import shutil
import sys
import tempfile


class Checks:
    """Counts passed checks, prints and remembers failed ones; finish() ends the run."""

    def __init__(self, prefix):
        self.tmp = tempfile.mkdtemp(prefix=prefix)  # unique per run
        self.failures = []
        self.passed = 0

    def __call__(self, name, ok, detail=""):
        if ok:
            self.passed += 1
        else:
            self.failures.append(name)
            print(f"FAILED: {name} {detail}")

    def finish(self):
        shutil.rmtree(self.tmp, ignore_errors=True)
        print(f"{self.passed} passed, {len(self.failures)} failed")
        sys.exit(1 if self.failures else 0)


def model_path(shared_arg, name="aidreams260K-q4_0.gguf"):
    """A model of the shared directory (TANDEM_SHARED, when set, wins over the argument)."""
    return os.path.join(os.environ.get("TANDEM_SHARED", shared_arg), "models", name)
