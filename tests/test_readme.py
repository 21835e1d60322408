"""README's numbers come from the committed result files."""

from pathlib import Path

from benchmarks.report import readme_with_results

ROOT = Path(__file__).resolve().parent.parent


def test_readme_measured_section_is_generated_from_results():
    text = (ROOT / "README.md").read_text()
    assert text == readme_with_results(text), "run `python benchmarks/report.py` after changing benchmarks/results/"
