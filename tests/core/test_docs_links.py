"""Every relative link of the manual resolves (issue 30).

README.md, CHANGELOG.md and docs/*.md link to each other, to images and to source files. A link
resolves when its file exists (relative to the linking file) and, for a ``#anchor``, the anchor is the
slug of a heading of the target Markdown file under GitHub's rules: the heading's text lowercased,
every character other than a letter, digit, ``-``, ``_`` or space removed, spaces turned into ``-``,
and the n-th repeat of a slug given the suffix ``-n``. Links inside code (fenced blocks, inline code
spans) are not links, and neither are headings inside fenced blocks.
"""

from __future__ import annotations

import pathlib
import re
from typing import Dict, Iterator, List, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MANUAL = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", *(ROOT / "docs").glob("*.md")])

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the text may hold one level of brackets ([`x`][y] is not used here)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def _prose_lines(text: str) -> Iterator[Tuple[int, str]]:
    """The lines outside fenced code blocks, with their numbers."""
    fenced = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = _FENCE.match(line)
        if fence:
            if fenced is None:
                fenced = fence.group(1)
            elif fence.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            yield number, line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before duplicates are numbered)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> List[str]:
    """Every heading anchor of a Markdown text, duplicates numbered as GitHub does."""
    seen: Dict[str, int] = {}
    out = []
    for _, line in _prose_lines(text):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        out.append(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def links(text: str) -> Iterator[Tuple[int, str]]:
    """The targets of a Markdown text's links and images, with their line numbers."""
    for number, line in _prose_lines(text):
        reference = _REFERENCE.match(line)
        if reference:
            yield number, reference.group(1)
            continue
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def broken_links(path: pathlib.Path, root: pathlib.Path = ROOT) -> List[str]:
    """What is wrong with each relative link of one Markdown file (named relative to ``root``)."""
    problems = []
    for number, target in links(path.read_text(encoding="utf-8")):
        if not target or _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        destination = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: ({target})"
        if not destination.exists():
            problems.append(f"{where} no such file {destination}")
            continue
        if anchor and destination.suffix == ".md":
            if anchor not in anchors(destination.read_text(encoding="utf-8")):
                problems.append(f"{where} no heading of {destination.name} has the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("path", MANUAL, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: pathlib.Path) -> None:
    assert broken_links(path) == []


def test_the_manual_is_found() -> None:
    names = {p.name for p in MANUAL}
    assert {"README.md", "CHANGELOG.md", "index.md", "design.md", "derivations.md"} <= names


def test_slugs_follow_github() -> None:
    assert slug("Opacus adapter (`hidden_state_accountants.opacus`)") == "opacus-adapter-hidden_state_accountantsopacus"
    assert slug("5a.1 A plan between two mixtures (Lemma 5a.1)") == "5a1-a-plan-between-two-mixtures-lemma-5a1"
    assert slug("Distributed training (tf.distribute)") == "distributed-training-tfdistribute"
    assert slug("What it buys — the numbers") == "what-it-buys--the-numbers"
    assert slug("The one-line switch") == "the-one-line-switch"
    assert slug("See [the design](design.md)") == "see-the-design"
    assert anchors("# A\n\n## A\n\n```\n# A\n```\n\n### A\n") == ["a", "a-1", "a-2"]


def test_broken_links_are_found(tmp_path: pathlib.Path) -> None:
    """The checker itself can fail: a missing file, a missing anchor, an in-page anchor."""
    (tmp_path / "b.md").write_text("# Title\n\n## Part two\n", encoding="utf-8")
    page = tmp_path / "a.md"
    page.write_text(
        "# Here\n\n[ok](b.md#part-two) [ok](#here) ![ok](b.md) [web](https://example.org/x.md) `[code](gone.md)`\n"
        "[gone](gone.md) [anchor](b.md#part-three) [in page](#there)\n\n```\n[fenced](gone.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 3, problems
    assert "(gone.md) no such file" in problems[0]
    assert "#part-three" in problems[1] and "#there" in problems[2]
