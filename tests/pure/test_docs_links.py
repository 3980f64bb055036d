"""The docs a newcomer reads hold together: every relative link in README.md and docs/ leads to a
file (and heading) that exists, the README fits on three screens, and nothing a user reads points
outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.paths import ROOT

README_MAX_LINES = 150
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
# Files outside the repository that the project was made from: a user cannot open them.
TEST_FILE = re.compile(r"\btests/[\w/]+\.py\b")
OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared|/work/shared|\b00[02]_[0-9a-f]{6,}|\b00[02]_\.\.\.txt")


def _prose(text: str) -> str:
    """The text a reader follows links in: code blocks and code spans taken out."""
    return CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for h in HEADING.findall(FENCE.sub("", page.read_text())):
        base, n = slug(h), 0
        while (s := base if n == 0 else f"{base}-{n}") in found:
            n += 1
        found.add(s)
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of `page` whose file, or heading, does not exist, or that leaves `root`."""
    out = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            out.append(f"{target} (no such file)")
        elif not dest.is_relative_to(root.resolve()):
            out.append(f"{target} (outside the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{target} (no heading #{anchor} in {dest.name})")
    return out


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/glossary.md", "docs/decisions/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_page_points_outside_the_repository(page: Path) -> None:
    hits = [m.group(0) for m in OUTSIDE.finditer(page.read_text())]
    assert hits == [], f"{page.relative_to(ROOT)} cites files a user does not have: {hits}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_test_file_named_exists(page: Path) -> None:
    """A page that names a test as what holds a promise names a file that is there (tests move)."""
    missing = sorted({t for t in TEST_FILE.findall(page.read_text()) if not (ROOT / t).is_file()})
    assert missing == [], f"{page.relative_to(ROOT)} names tests that do not exist: {missing}"


def test_the_readme_fits_on_three_screens() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_a_broken_link_and_a_missing_heading_are_caught(tmp_path: Path) -> None:
    """The check itself can fail: a missing file, a missing heading and a way out are named; code,
    web links and good links are not."""
    (tmp_path / "there.md").write_text("# A heading: with `code`\n")
    (tmp_path / "sub").mkdir()
    page = tmp_path / "sub" / "page.md"
    page.write_text("[ok](../there.md#a-heading-with-code) [gone](nowhere.md) [bad](../there.md#nope) "
                    "`[code](is-not-a-link.md)` [web](https://example.com/x)\n")
    assert broken_links(page, root=tmp_path) == ["nowhere.md (no such file)",
                                                 "../there.md#nope (no heading #nope in there.md)"]
    assert broken_links(page, root=tmp_path / "sub") == [
        "../there.md#a-heading-with-code (outside the repository)", "nowhere.md (no such file)",
        "../there.md#nope (outside the repository)"]


def test_decision_records_have_their_sections() -> None:
    """Every record in docs/decisions/ says its status and has Context, Decision, Consequences, Tests;
    a superseded record links to a record that exists and says it supersedes it."""
    records = sorted(p for p in (ROOT / "docs" / "decisions").glob("*.md") if p.name != "README.md")
    assert records
    index = (ROOT / "docs" / "decisions" / "README.md").read_text()
    for rec in records:
        text = rec.read_text()
        for section in ("Context", "Decision", "Consequences", "Tests"):
            assert re.search(rf"^(#+ {section}\b|\*\*{section}\b)", text, re.M), f"{rec.name}: no {section} section"
        assert rec.name in index, f"{rec.name} is not in docs/decisions/README.md"
        m = re.search(r"superseded by \[[^\]]*\]\(([^)]+)\)", text)
        if m:
            newer = rec.parent / m.group(1)
            assert newer.exists(), f"{rec.name}: superseded by {m.group(1)}, which does not exist"
            assert rec.stem in newer.read_text(), f"{newer.name} does not say it supersedes {rec.name}"
