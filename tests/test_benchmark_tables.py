"""benchmarks/README.md's tables are the ones benchmarks/tables.py renders from benchmarks/results."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tables_are_current():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
