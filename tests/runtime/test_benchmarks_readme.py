"""benchmarks/README.md stays true: every results file and script it names exists (a renamed or dropped
file must be changed there too)."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _named(pattern: str) -> list[str]:
    return re.findall(pattern, (BENCH / "README.md").read_text())


def test_results_files_it_names_exist():
    names = _named(r"`([\w*.-]+\.md)`")
    assert len(names) >= 10
    missing = [n for n in names if n != "README.md" and not list((BENCH / "results").glob(n))]
    assert not missing, f"benchmarks/README.md names results files that do not exist: {missing}"


def test_scripts_it_names_exist_and_every_script_is_listed():
    named = set(_named(r"`([\w-]+\.(?:py|sh))`"))
    on_disk = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
    assert named - on_disk == set(), f"benchmarks/README.md names scripts that do not exist: {named - on_disk}"
    assert on_disk - named == set(), f"scripts missing from benchmarks/README.md: {on_disk - named}"
