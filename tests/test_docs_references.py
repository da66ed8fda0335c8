"""Every document, script or benchmark that the code, the tests or the docs point at is in the repository:
a reader who follows `docs/formats.md §6` or `benchmarks/bench_real_layers.py` finds it, and nothing cites a
document the repository does not have."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".j2", ".toml", ".txt", ".cfg"}
# a repository path as the code and docs write it: docs/x.md, benchmarks/x.py, scripts/x.sh, tests/..., ...
PATH_REF = re.compile(
    r"(?<![\w/.-])((?:docs|benchmarks|scripts|patches|recipes|tests|\.ci)/[\w./*-]*[\w*]"
    r"|(?:README|CONTRIBUTING|DESIGN)\.md)"
)
SECTION_REF = re.compile(r"docs/formats\.md §(\d+)(?:-(\d+))?")
MD_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# documents that live outside the repository, cited by name in earlier text
OUTSIDE = re.compile(r"(?i:formats doc|reference doc|the seed\b|seed \")|(?<!docs/)DESIGN\.md")


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / n for n in names.splitlines() if Path(n).suffix in TEXT_SUFFIXES and (ROOT / n).is_file()]


def _lines(skip_self: bool = True):
    """(file, line number, line) of every tracked text file (this test's own file left out)."""
    for f in _tracked_text_files():
        if skip_self and f.name == "test_docs_references.py":
            continue
        for lineno, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            yield f, lineno, line


def _exists(ref: str, cited_in: Path) -> bool:
    ref = ref.rstrip(".")
    if "NAME" in ref or any(ch in ref for ch in "{<"):  # a placeholder, not a file
        return True
    if "*" in ref:  # a pattern: it must match something
        return any(ROOT.glob(ref)) or any(cited_in.parent.glob(ref))
    return (ROOT / ref).exists() or (cited_in.parent / ref).exists()


def _formats_sections() -> set[int]:
    text = (ROOT / "docs/formats.md").read_text()
    return {int(n) for n in re.findall(r"^## (\d+)\.", text, flags=re.M)}


def test_every_repository_path_cited_exists():
    missing = []
    for f, lineno, line in _lines():
        if "docs-ref: not a repository path" in line:
            continue
        for ref in PATH_REF.findall(line):
            if not _exists(ref, f):
                missing.append(f"{f.relative_to(ROOT)}:{lineno}: {ref}")
    assert not missing, "references to files the repository does not have:\n" + "\n".join(missing)


def test_markdown_links_point_at_files_in_the_repository():
    missing = []
    for f in _tracked_text_files():
        if f.suffix != ".md":
            continue
        for lineno, line in enumerate(f.read_text().splitlines(), 1):
            for target in MD_LINK.findall(line):
                if "://" in target or target.startswith("mailto:"):
                    continue
                # docs/_*.md are parts of README.md, whose links are relative to the repository's root
                base = ROOT if f.name.startswith("_") and f.parent.name == "docs" else f.parent
                if not (base / target).exists():
                    missing.append(f"{f.relative_to(ROOT)}:{lineno}: {target}")
    assert not missing, "broken links:\n" + "\n".join(missing)


def test_formats_sections_cited_exist():
    sections = _formats_sections()
    bad = []
    for f, lineno, line in _lines(skip_self=False):
        for first, last in SECTION_REF.findall(line):
            wanted = range(int(first), int(last or first) + 1)
            if not set(wanted) <= sections:
                bad.append(f"{f.relative_to(ROOT)}:{lineno}: §{first}{'-' + last if last else ''}")
    assert not bad, f"docs/formats.md has sections {sorted(sections)}; cited:\n" + "\n".join(bad)


def test_nothing_cites_a_document_outside_the_repository():
    cited = [
        f"{f.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}" for f, lineno, line in _lines() if OUTSIDE.search(line)
    ]
    assert not cited, "cites a document the repository does not have:\n" + "\n".join(cited)


@pytest.mark.parametrize("page", ["README.md", "CONTRIBUTING.md", "docs/design.md", "docs/formats.md"])
def test_project_pages_tell_no_development_history(page):
    text = (ROOT / page).read_text()
    history = re.findall(r"\bsession \d+\b|\b[0-9a-f]{10,40}\b|\bH(?:100|200) [A-Z]\b", text)
    assert not history, f"{page} speaks of its own development: {history[:5]}"


def test_readme_is_for_users_and_short():
    assert len((ROOT / "README.md").read_bytes()) < 40_000
