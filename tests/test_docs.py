"""The documentation (issue 32): the reference pages are generated from the code and fresh;
the site builds in strict mode (a broken link or anchor fails); every example configuration
in the pages loads; the glossary's words link to it where the README and the getting-started
page first use them; design references point into docs/design.md."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tls_support import Pki, make_pki

from kvledger.config.loader import load_config
from kvledger.config.reference import MEANING, field_paths
from kvledger.config.types import ConfigError
from kvledger.output.catalog import CATALOG, LABELS
from kvledger.tools.docgen import TARGETS, main

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])


# ---------------------------------------------------------------- generated references

def test_every_generated_section_is_fresh() -> None:
    assert main(["--check"]) == 0, "run make docs (python -m kvledger.tools.docgen)"


def test_each_target_holds_its_generated_sections() -> None:
    texts = {t: (ROOT / t).read_text() for t in TARGETS}
    assert "<!-- BEGIN METRIC REFERENCE" in texts["docs/metrics.md"]
    assert "<!-- BEGIN LABEL REFERENCE" in texts["docs/metrics.md"]
    assert "<!-- BEGIN ERROR REASONS" in texts["docs/metrics.md"]
    assert "<!-- BEGIN CONFIGURATION REFERENCE" in texts["docs/configuration.md"]
    assert "<!-- BEGIN ENGINE KINDS" in texts["docs/engines/index.md"]


def test_the_metric_reference_lists_every_family_with_its_stability() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    for m in CATALOG:
        (row,) = [line for line in text.splitlines() if line.startswith(f"| `{m.name}` |")]
        assert f"| {m.stability} |" in row and f"| {m.type} |" in row, row
    for name in LABELS:
        assert f'<a id="label-{name}"></a>`{name}`' in text


def test_a_stale_reference_is_detected_and_rewritten(tmp_path: Path) -> None:
    for name, old, new in [("metrics.md", "`kvledger_kv_capacity_bytes`", "`kvledger_old_name`"),
                           ("configuration.md", "`engines[].max_num_seqs`", "`engines[].max_seqs`")]:
        page = tmp_path / name
        page.write_text((ROOT / "docs" / name).read_text().replace(old, new, 1))
        assert main(["--check", str(page)]) == 1
        assert main([str(page)]) == 0 and main(["--check", str(page)]) == 0
        assert page.read_text() == (ROOT / "docs" / name).read_text()


def test_every_key_of_the_typed_configuration_has_a_meaning() -> None:
    """A field added to config/types.py without its meaning (config/reference.py) fails here."""
    assert sorted(field_paths() - set(MEANING)) == []
    assert sorted(set(MEANING) - field_paths()) == []


# ---------------------------------------------------------------- the site

MKDOCS = Path(sys.executable).with_name("mkdocs")


def _build(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(MKDOCS), "build", "--strict", "--config-file", str(config)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, cwd=config.parent)


def _build_config(where: Path, config: dict[str, object]) -> subprocess.CompletedProcess[str]:
    (where / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return _build(where / "mkdocs.yml")


def test_the_site_builds_in_strict_mode() -> None:
    res = _build(ROOT / "mkdocs.yml")
    assert res.returncode == 0, res.stdout + res.stderr
    assert (ROOT / "tests" / "_build" / "site" / "getting-started" / "index.html").exists()


def test_a_broken_anchor_fails_the_build(tmp_path: Path) -> None:
    """Strict mode is what makes a broken link fail: the site's own settings, on two of its pages
    with one bad anchor added, do not build."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    config.update(nav=["glossary.md", "policy.md"], not_in_nav="", site_dir=str(tmp_path / "site"))
    (tmp_path / "docs").mkdir()
    for page in ("glossary.md", "policy.md"):
        text = (ROOT / "docs" / page).read_text()
        text = re.sub(r"\]\((?!glossary\.md|policy\.md|#|https?:)[^)]*\)", "](#)", text)  # links to pages left out
        (tmp_path / "docs" / page).write_text(text)
    assert _build_config(tmp_path, config).returncode == 0  # as they are, they build
    glossary = tmp_path / "docs" / "glossary.md"
    glossary.write_text(glossary.read_text() + "\nSee [the formulas](policy.md#no-such-section).\n")
    res = _build_config(tmp_path, config)
    assert res.returncode == 1
    assert "does not contain an anchor '#no-such-section'" in res.stdout + res.stderr


def test_every_page_under_docs_is_in_the_site() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"(?:^|\s)([\w./-]+\.md)\s*$", nav, re.MULTILINE))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    # a page outside the navigation must be named in not_in_nav; others' new pages go in the nav
    allowed_outside = {"nvml-device-check.md"} | ({"contributing.md"} if "contributing.md" not in listed else set())
    assert sorted(pages - listed - allowed_outside) == []


# ---------------------------------------------------------------- example configurations

FENCE = re.compile(r"^```ya?ml\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _kvledger_examples() -> list[tuple[str, str]]:
    """Every YAML block of the pages that is a kvledger configuration (it has an engines: list)."""
    out = []
    for page in PAGES:
        for i, block in enumerate(FENCE.findall(page.read_text())):
            try:
                data = yaml.safe_load(block)
            except yaml.YAMLError:
                continue
            if isinstance(data, dict) and isinstance(data.get("engines"), list):
                out.append((f"{page.relative_to(ROOT)}#{i}", block))
    # the example files the pages point to
    out += [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "deploy" / "examples").glob("*.yml"))]
    return out


EXAMPLES = _kvledger_examples()


def test_the_pages_hold_example_configurations() -> None:
    names = {name.split("#")[0] for name, _ in EXAMPLES}
    assert {"README.md", "docs/configuration.md", "docs/getting-started.md", "deploy/examples/vllm.yml"} <= names


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.mark.parametrize(("name", "block"), EXAMPLES, ids=[n for n, _ in EXAMPLES])
def test_every_example_configuration_in_the_docs_loads(tmp_path: Path, pki: Pki, name: str, block: str) -> None:
    """As written: the files it names are made (a model's config.json, a token, certificates that
    load), nothing else about it is changed."""
    pem = {"ca": pki.ca, "client.pem": pki.client_cert, "client-key": pki.client_key, "key": pki.client_key,
           "cert": pki.client_cert}
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text(block)
    made: list[str] = []
    for _ in range(10):
        try:
            config = load_config(cfg)
            break
        except ConfigError as exc:
            missing = re.search(r"cannot read (\S+): No such file or directory", str(exc))
            assert missing, f"{name}: {exc}"
            path = Path(missing.group(1))
            assert tmp_path in path.parents, f"{name}: names a file outside its directory: {path}"
            path.parent.mkdir(parents=True, exist_ok=True)
            source = next((v for k, v in pem.items() if k in path.name), None)
            path.write_bytes(source.read_bytes() if source else b"{}" if path.suffix == ".json" else b"secret\n")
            made.append(path.name)
    else:
        pytest.fail(f"{name}: still failing after making {made}")
    assert config.engines, name


def test_a_contradictory_example_would_be_caught(tmp_path: Path) -> None:
    """The loader refuses what the old README's reference showed: llama.cpp keys on a vllm entry."""
    cfg = tmp_path / "kvledger.yml"
    cfg.write_text("engines:\n  - {name: e, kind: vllm, url: 'http://127.0.0.1:8000/metrics', kv_unified: true}\n")
    with pytest.raises(ConfigError, match="kv_unified is for kind llamacpp only"):
        load_config(cfg)


# ---------------------------------------------------------------- the glossary

GLOSSARY = {
    "pool": r"\bpools?\b", "reserved": r"\breserv(?:ed|ation)\b", "allocated": r"\ballocated\b",
    "reclaimable": r"\breclaimable\b", "basis": r"\bbasis\b", "tenant": r"\btenants?\b",
    "dynamic-admission": r"\bdynamic admission\b", "reserve-cap-admission": r"\breserve-cap admission\b",
    "rr": r"\bR\(r\)", "epp": r"\bEPP\b", "group": r"\bKV-cache groups?\b",
}


def _prose(text: str) -> str:
    """The page without code blocks, code spans or headings (where a word is not "used")."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"^#.*$", "", text, flags=re.MULTILINE)
    return re.sub(r"`[^`]*`", "", text)


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md", "docs/index.md", "docs/policy.md",
                                  "docs/routers.md"])
def test_each_glossary_word_links_to_it_where_first_used(page: str) -> None:
    text = _prose((ROOT / page).read_text())
    glossary = (ROOT / "docs" / "glossary.md").read_text()
    prefix = "docs/glossary.md" if page == "README.md" else "glossary.md"
    unlinked = []
    for anchor, word in GLOSSARY.items():
        assert f"{{#{anchor}}}" in glossary, anchor
        first = re.search(word, text, re.IGNORECASE)
        if first is None:
            continue
        # the first use sits inside a link to the word's entry: [...word...](glossary.md#anchor)
        link = re.compile(r"\[[^\]]*\]\(" + re.escape(f"{prefix}#{anchor}") + r"\)")
        if not any(m.start() <= first.start() < m.end() for m in link.finditer(text)):
            unlinked.append(f"{anchor}: {text[max(0, first.start() - 40):first.end() + 20]!r}")
    assert unlinked == []


# ---------------------------------------------------------------- design references

def test_design_references_point_into_docs_design() -> None:
    """Contributors read docs/design.md: every "docs/design.md §N" names a section of it, and
    no reference points at the old out-of-repository DESIGN sections."""
    design = (ROOT / "docs" / "design.md").read_text()
    sections = set(re.findall(r"^## (\d+b?)\. ", design, re.MULTILINE))
    bad: list[str] = []
    for path in [*ROOT.glob("exporter/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"),
                 *ROOT.glob("alerts/**/*.y*ml"), *ROOT.glob("alerts/*.py"), *ROOT.glob("docs/**/*.md"), ROOT / "README.md"]:
        if "_build" in path.parts:
            continue
        text = path.read_text()
        for ref in re.findall(r"docs/design\.md §(\d+b?)", text):
            if ref not in sections:
                bad.append(f"{path.relative_to(ROOT)}: docs/design.md §{ref} does not exist")
        if re.search(r"DESIGN(\.md)? (§|section)", text) and path.name != "test_docs.py":
            bad.append(f"{path.relative_to(ROOT)}: refers to DESIGN sections outside the repository")
    assert bad == []
