"""The documentation, as rules a test keeps from drifting: a short README, and no link in it or in
docs/ that leads nowhere.

A link is an inline Markdown link or image, `[text](target)` / `![alt](target)`, or a reference
definition, `[label]: target`, outside code (fenced blocks and inline code spans are not links).
External links (http, https, mailto) are not followed. A `#anchor` must name a heading of the
file it points into, slugged as GitHub does.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200

_FENCE = re.compile(r"^ {0,3}(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:|//)", re.IGNORECASE)


def _doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").rglob("*.md"))]


def _prose_lines(path: Path, blank_inline_code: bool = True) -> list[str]:
    """The file's lines outside fenced code blocks (blank inside them), inline code spans blanked
    unless told otherwise."""
    lines: list[str] = []
    fence: str | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        opener = _FENCE.match(line)
        if fence is not None:
            if opener and opener.group(1) == fence:
                fence = None
            lines.append("")
        elif opener:
            fence = opener.group(1)
            lines.append("")
        elif blank_inline_code:
            lines.append(_INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line))
        else:
            lines.append(line)
    return lines


def links(path: Path) -> list[str]:
    """Every link target in a Markdown file, in order."""
    found: list[str] = []
    for line in _prose_lines(path):
        found += [m.group(1) for m in _INLINE_LINK.finditer(line)]
        ref = _REFERENCE.match(line)
        if ref:
            found.append(ref.group(1))
    return found


def github_slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the heading's text, lowercased, without punctuation
    (letters, digits, underscores, hyphens and spaces stay), spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text, not its target
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown file's headings make, a repeated slug numbered as GitHub does."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for line in _prose_lines(path, blank_inline_code=False):  # a heading's code text is in its slug
        heading = _HEADING.match(line)
        if not heading:
            continue
        slug = github_slug(heading.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        result.add(slug if count == 0 else f"{slug}-{count}")
    return result


def _relative_links(path: Path) -> list[tuple[str, Path, str]]:
    """(the link as written, the file it points to, its anchor or "") for every relative link."""
    result = []
    for target in links(path):
        if not target or _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / unquote(file_part)).resolve() if file_part else path
        result.append((target, resolved, unquote(anchor)))
    return result


def _ids(paths: list[Path]) -> list[str]:
    return [str(p.relative_to(ROOT)) for p in paths]


DOC_FILES = _doc_files()


def test_the_readme_is_at_most_200_lines() -> None:
    num_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert num_lines <= MAX_README_LINES, (
        f"README.md has {num_lines} lines; keep it at most {MAX_README_LINES} and move the rest "
        "to a page under docs/")


@pytest.mark.parametrize("path", DOC_FILES, ids=_ids(DOC_FILES))
def test_every_relative_link_in_the_docs_resolves(path: Path) -> None:
    broken = [target for target, resolved, _ in _relative_links(path) if not resolved.exists()]
    assert not broken, f"{path.relative_to(ROOT)} links to files that do not exist: {broken}"


@pytest.mark.parametrize("path", DOC_FILES, ids=_ids(DOC_FILES))
def test_every_anchor_in_a_docs_link_names_a_heading_of_its_target(path: Path) -> None:
    broken = [target for target, resolved, anchor in _relative_links(path)
              if anchor and resolved.suffix == ".md" and resolved.is_file()
              and anchor not in anchors(resolved)]
    assert not broken, f"{path.relative_to(ROOT)} links to headings that do not exist: {broken}"


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    reached: set[Path] = set()
    todo = [README.resolve()]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        todo += [resolved for _, resolved, _ in _relative_links(page)
                 if resolved.suffix == ".md" and resolved.is_file()]
    unreached = [p for p in DOC_FILES if p.resolve() not in reached]
    assert not unreached, f"no chain of links from README.md reaches {_ids(unreached)}"


@pytest.mark.parametrize(("heading", "slug"), [
    ("P/D push mode (`NixlPushConnector`)", "pd-push-mode-nixlpushconnector"),
    ("`kvrelay up` options", "kvrelay-up-options"),
    ("Latest: 2026-12-03 14:11-14:34 UTC", "latest-2026-12-03-1411-1434-utc"),
    ("Why P/D was mispredicted: decode cost", "why-pd-was-mispredicted-decode-cost"),
    ("The [planner](planning.md) and kv_cache_dtype", "the-planner-and-kv_cache_dtype"),
])
def test_anchors_are_slugged_as_github_slugs_headings(heading: str, slug: str) -> None:
    assert github_slug(heading) == slug


def test_links_inside_code_are_not_links(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("[a](a.md) `[b](b.md)`\n```\n[c](c.md)\n```\n![d](img/d.png)\n[e]: e.md\n",
                    encoding="utf-8")
    assert links(page) == ["a.md", "img/d.png", "e.md"]
