"""Generated documentation stays in step with the catalogue."""

from __future__ import annotations

from pathlib import Path

from kvledger.output.catalog import CATALOG
from kvledger.tools.docgen import main

ROOT = Path(__file__).resolve().parents[1]


def test_readme_metric_reference_is_fresh() -> None:
    assert main(["--check", str(ROOT / "README.md")]) == 0


def test_readme_lists_every_metric() -> None:
    text = (ROOT / "README.md").read_text()
    assert all(f"`{m.name}`" in text for m in CATALOG)


def test_stale_reference_detected(tmp_path: Path) -> None:
    stale = (ROOT / "README.md").read_text().replace("`kvledger_kv_capacity_bytes`", "`kvledger_old_name`", 1)
    p = tmp_path / "README.md"
    p.write_text(stale)
    assert main(["--check", str(p)]) == 1
    assert main([str(p)]) == 0 and main(["--check", str(p)]) == 0


def test_design_references_point_into_docs_design() -> None:
    """Contributors read docs/design.md: every "docs/design.md §N" names a section of it, and
    no reference points at the old out-of-repository DESIGN sections."""
    import re

    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+b?)\. ", design, re.MULTILINE))
    bad: list[str] = []
    for path in [*ROOT.glob("exporter/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"),
                 *ROOT.glob("alerts/**/*.y*ml"), *ROOT.glob("alerts/*.py"), *ROOT.glob("docs/**/*.md"), ROOT / "README.md"]:
        text = path.read_text()
        for ref in re.findall(r"docs/design\.md §(\d+b?)", text):
            if ref not in sections:
                bad.append(f"{path.relative_to(ROOT)}: docs/design.md §{ref} does not exist")
        if re.search(r"DESIGN(\.md)? (§|section)", text) and path.name != "test_docs.py":
            bad.append(f"{path.relative_to(ROOT)}: refers to DESIGN sections outside the repository")
    assert bad == []
