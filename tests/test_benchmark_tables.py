"""benchmarks/README.md's tables are the ones benchmarks/tables.py renders from benchmarks/results."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_tables_are_current():
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_check_fails_on_missing_and_unused_result_files(tmp_path, monkeypatch):
    """`tables.py --check` also keeps benchmarks/results to what the README shows: a result file or plot it names must
    exist, every JSON file must feed a table, every PNG must be shown by a README."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import tables

    results = tmp_path / "results"
    (results / "gemma").mkdir(parents=True)
    used, orphan, plot = results / "a.json", results / "gemma" / "old_run.json", results / "gemma" / "a.png"
    for path in (used, orphan, plot):
        path.write_text("{}")
    monkeypatch.setattr(tables, "RESULTS", results)
    monkeypatch.setattr(tables, "USED", set())
    tables.load("a")
    readme = "Table of `results/a.json`; see also results/gone.json and ![plot](results/gemma/a.png)."
    problems = tables.file_problems([readme])
    assert any("missing file: results/gone.json" in p for p in problems), problems
    assert any("results/gemma/old_run.json feeds no table" in p for p in problems), problems
    assert not any("a.png" in p or p.endswith("a.json") for p in problems), problems
    assert tables.file_problems(["only `results/a.json`"]) == [
        "results/gemma/a.png is shown by no README", "results/gemma/old_run.json feeds no table (delete it: git "
        "keeps superseded runs)"]


def test_a_result_file_holds_a_run_per_label(tmp_path, monkeypatch):
    """`save_run` (and `tables.py --add-run`) replaces the run of its label and keeps the others; `load` reads one run
    by its label, `saved_run` gives None where there is none yet."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import tables

    monkeypatch.setattr(tables, "RESULTS", tmp_path)
    monkeypatch.setattr(tables, "USED", set())
    path = tmp_path / "bench.json"
    for label, value in (("avx2", 1), ("avx512bf16", 2), ("avx2", 3)):
        tables.save_run(path, label, {"x": value, "machine": {"cpu": label}})
    assert tables.load("bench", "avx2")["x"] == 3 and tables.load("bench", "avx512bf16")["x"] == 2
    assert tables.USED == {path} and "machine" not in json.loads(path.read_text())  # each run carries its own
    assert tables.saved_run(path, "torch") is None and tables.saved_run(tmp_path / "none.json", "avx2") is None
    run = tmp_path / "out.json"
    run.write_text('{"points": {}}')
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tables.py"), "--add-run", str(run), str(path), "avx2"],
                   check=True, capture_output=True, timeout=120)
    assert tables.load("bench", "avx2") == {"points": {}} and tables.load("bench", "avx512bf16")["x"] == 2
