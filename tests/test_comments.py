"""Comments and docstrings in the package say why, not when: no issue numbers ("#15", "issue
12") and no session numbers ("session 11", "sessions 8-9"). Those go stale and mean nothing to a
reader without the tracker; the measurement history lives in docs/measurements/, and a figure a
constant rests on names that page and the command that measured it."""

from __future__ import annotations

import io
import re
import textwrap
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "skulkp2p"

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
             "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|"
             "twentieth|[0-9]+(?:st|nd|rd|th)")
CITATIONS = [
    # "#15", "#15's aim", "(#19)", "README #15"; not a colour ("#0f766e"), a URL fragment
    # ("page#s2") or an HTML entity ("&#39;").
    ("issue", re.compile(r"(?<![\w&#/.-])#[0-9]+(?![\w-])")),
    ("issue", re.compile(r"\b(?:issues?|PR|pull request)\s*#?[0-9]+\b", re.I)),
    # "session 11", "(session 10's", "sessions 8-9"
    ("session", re.compile(r"\bsessions?\s*#?[0-9]+", re.I)),
    # "the tenth session", "after the 18th session"
    ("session", re.compile(rf"\b(?:{_ORDINALS})\s+session\b", re.I)),
]

_TEXT_TOKENS = {tokenize.COMMENT, tokenize.STRING}
if hasattr(tokenize, "FSTRING_MIDDLE"):  # Python 3.12+: an f-string's literal parts
    _TEXT_TOKENS.add(tokenize.FSTRING_MIDDLE)


def citations(source: str) -> list[tuple[int, str, str]]:
    """(line, kind, the text cited) for every issue or session number in `source`'s comments
    and string literals (docstrings included)."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in _TEXT_TOKENS:
            continue
        # A comment's own "#" is not a reference ("#1 ..." would otherwise read as one).
        text = tok.string.lstrip("#") if tok.type == tokenize.COMMENT else tok.string
        skipped = len(tok.string) - len(text)
        for kind, pattern in CITATIONS:
            for m in pattern.finditer(text):
                line = tok.start[0] + tok.string.count("\n", 0, skipped + m.start())
                found.append((line, kind, m.group(0)))
    return sorted(found)


def citations_in(path: Path) -> list[str]:
    """`file:line: kind "text"` for every citation in the Python file at `path`."""
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    return [f'{name}:{line}: {kind} number "{" ".join(text.split())}"'
            for line, kind, text in citations(path.read_text(encoding="utf-8"))]


def test_the_package_cites_no_issue_or_session_numbers():
    files = sorted(PKG.rglob("*.py"))
    assert len(files) > 50  # the scan found the package
    hits = [hit for path in files for hit in citations_in(path)]
    assert not hits, ("comments and docstrings say why, without issue or session numbers (the "
                      "history is in docs/measurements/):\n" + "\n".join(hits))


def test_the_scan_finds_the_citations_it_is_for():
    source = textwrap.dedent('''\
        """Rotary embeddings.

        Measured in session 18 (README #15, "The head's confidence").
        """
        X = 3  # 3, not 2 (session 11): see #17's aim
        # as before #15's second round; sessions 8-9 and the tenth session
        def f():
            """Issue 9: exact. (#19)"""
            log.info("off, see issue #12")
        ''')
    assert citations(source) == [
        (3, "issue", "#15"), (3, "session", "session 18"),
        (5, "issue", "#17"), (5, "session", "session 11"),
        (6, "issue", "#15"), (6, "session", "sessions 8"), (6, "session", "tenth session"),
        (8, "issue", "#19"), (8, "issue", "Issue 9"),
        (9, "issue", "#12"), (9, "issue", "issue #12"),
    ]


def test_the_scan_leaves_what_is_not_a_citation_alone():
    source = textwrap.dedent('''\
        """A session's earlier requests go first; round 1's draft 1; see page#s2."""
        COLOUR = "#0f766e"  # the dashboard's speed colour; &#39; is an apostrophe
        # 1. prefill  # 2. decode
        #1 is the first stage
        ROWS = 16  # 1.5x at 16 rows: docs/measurements/decode-loop.md (bench --widths)
        x = f"{n} sessions open"  # one session per request
        ''')
    assert citations(source) == []
