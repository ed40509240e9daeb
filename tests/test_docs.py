"""The documentation holds together: the README stays a short user's guide that links every
reference page, every relative link in the README and docs/*.md resolves (to a file, and to a
heading where it names one), the README cites no issue or session numbers, and docs/cli.md is
what the argument parsers generate. Plain file reads: no processes, no models."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 300

FENCE = re.compile(r"^ {0,3}(```|~~~)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
             "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|"
             "twentieth|[0-9]+(?:st|nd|rd|th)")
HISTORY = [  # the patterns tests/test_comments.py holds the code to
    re.compile(r"(?<![\w&#/.-])#[0-9]+(?![\w-])"),  # "#15", "(#19)"; not "&#39;" or "page#s2"
    re.compile(r"\b(?:issues?|PR|pull request)\s*#?[0-9]+\b", re.I),  # "issue 16", "PR 7"
    re.compile(r"\bsessions?\s*#?[0-9]+", re.I),  # "session 11", "sessions 8-9"
    re.compile(rf"\b(?:{_ORDINALS})\s+session\b", re.I),  # "the tenth session"
]
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:, ...


def doc_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def links(text: str) -> list[str]:
    """Every link target in the prose (not in code blocks or code spans); a link's text may
    wrap onto the next line."""
    return LINK.findall("\n".join(INLINE_CODE.sub("", line) for line in prose_lines(text)))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, markup and punctuation dropped, spaces as
    hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    counts: dict[str, int] = {}
    found = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        found.add(base if base not in counts else f"{base}-{counts[base]}")
        counts[base] = counts.get(base, 0) + 1
    return found


def broken_links(path: Path) -> list[str]:
    """The relative links of one Markdown file that lead nowhere: a missing file or folder, or
    a heading the target page does not have."""
    broken = []
    for target in links(path.read_text(encoding="utf-8")):
        if EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = path.parent / unquote(file_part) if file_part else path
        if not dest.exists():
            broken.append(f"{target} (no such file or folder)")
        elif anchor and dest.is_file() and dest.suffix == ".md" \
                and unquote(anchor) not in anchors(dest):
            broken.append(f"{target} (no heading #{anchor} there)")
    return broken


def issue_and_session_numbers(text: str) -> list[str]:
    """Issue references (`#` and digits) and session numbers in prose, code spans included;
    link targets such as `(#section)` and fenced code blocks do not count."""
    prose = LINK.sub(lambda m: m.group(0)[: m.group(0).rindex("](") + 1],
                     "\n".join(prose_lines(text)))
    return [m.group(0) for pattern in HISTORY for m in pattern.finditer(prose)]


# --- the checks on the real files --------------------------------------------------------------


def test_readme_is_short():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, (f"README.md has {n} lines, more than {README_MAX_LINES}: move "
                                   "reference material to a page in docs/ and link it")


def test_readme_links_every_docs_page_and_the_measurements():
    targets = {posixpath.normpath(unquote(t.partition("#")[0]))
               for t in links(README.read_text(encoding="utf-8"))}
    wanted = [f"docs/{p.name}" for p in doc_pages()] + ["docs/measurements"]
    missing = [w for w in wanted if w not in targets]
    assert not missing, f"README.md does not link {', '.join(missing)}: add it to its docs index"


@pytest.mark.parametrize("page", [README, *doc_pages()],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)}: broken links: " + "; ".join(broken)


def test_readme_cites_no_issue_or_session_numbers():
    found = issue_and_session_numbers(README.read_text(encoding="utf-8"))
    assert not found, (f"README.md cites {', '.join(found)}: the README never cites issue or "
                       "session numbers (history belongs in docs/measurements/ and CHANGELOG.md)")


def test_cli_reference_is_up_to_date():
    from skulkp2p.cli_reference import render

    current = (DOCS / "cli.md").read_text(encoding="utf-8")
    assert current == render(), ("docs/cli.md is out of date with the argument parsers: run "
                                 "`python -m skulkp2p.cli_reference > docs/cli.md`")


# --- the checkers catch what they are for ------------------------------------------------------


def test_the_link_checker_finds_a_missing_file_and_a_missing_heading(tmp_path: Path):
    (tmp_path / "other.md").write_text("# Title\n\n## A `flag`: --x\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md) [ok](other.md#a-flag---x) [web](https://example.org/x)\n"
                    "[here](#local) `[code](gone.md)`\n```\n[fenced](gone.md)\n```\n## Local\n"
                    "[gone](gone.md) [bad\nanchor](other.md#nope)\n", encoding="utf-8")
    broken = broken_links(page)
    assert len(broken) == 2 and broken[0].startswith("gone.md") and "#nope" in broken[1]


def test_slugs_follow_githubs_rules():
    assert slug("`python -m skulkp2p join`") == "python--m-skulkp2p-join"
    assert slug("A verify's exponentials in numpy (session 17)") == \
        "a-verifys-exponentials-in-numpy-session-17"
    assert slug("/v1/stats") == "v1stats"
    assert slug("Through a cluster: `pipe --peer`") == "through-a-cluster-pipe---peer"


def test_the_history_checker_finds_issue_and_session_numbers():
    assert issue_and_session_numbers("Fixed in #15, second round.") == ["#15"]
    assert issue_and_session_numbers("Measured in session 18.") == ["session 18"]
    assert issue_and_session_numbers("`bench` (#16)") == ["#16"]
    assert issue_and_session_numbers("as issue 16 asked") == ["issue 16"]
    assert issue_and_session_numbers("after the eighteenth session") == ["eighteenth session"]
    assert issue_and_session_numbers("See [the API](docs/http-api.md#2-errors) and "
                                     "[this](#section), the &#160; entity.\n"
                                     "```\n# 1 a comment, session 3\n```\n") == []
