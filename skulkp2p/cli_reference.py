"""The command-line reference in Markdown, built from the real argument parsers.

`render()` walks the parser that `skulkp2p.cli.build_parser()` returns, its sub-commands and
their nested sub-commands (`models pull`, `cards show`), and writes for each one a heading, its
description, a usage line and a table of its arguments with their help text and defaults.

    python -m skulkp2p.cli_reference > docs/cli.md

writes docs/cli.md; tests/test_docs.py checks that the file equals `render()`. The output does
not depend on the terminal's width, the Python version's help formatter or the machine: usage
lines are built and wrapped here at a fixed width, and nothing reads the environment.
"""

from __future__ import annotations

import argparse

WIDTH = 100  # usage lines wrap here
PROG = "python -m skulkp2p"

HEADER = """\
# Command-line reference

<!-- Generated from the argument parsers in skulkp2p/cli.py. Do not edit by hand: run
     python -m skulkp2p.cli_reference > docs/cli.md -->

This page is generated from the argument parsers in `skulkp2p/cli.py` by
`python -m skulkp2p.cli_reference > docs/cli.md`; a test fails when it is out of date. Every
command also takes `-h`/`--help`. Options of the top-level command (`--log-level`) go before the
command's name: `python -m skulkp2p --log-level debug join`.
"""


def render() -> str:
    """The whole reference page, ending in one newline."""
    from skulkp2p.cli import build_parser

    out: list[str] = [HEADER]
    _parser_section(out, build_parser(), [], None)
    return "\n".join(out).rstrip("\n") + "\n"


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action
    return None


def _parser_section(out: list[str], parser: argparse.ArgumentParser, path: list[str],
                    help_text: str | None) -> None:
    name = " ".join([PROG, *path])
    out.append(f"{'#' * min(2 + max(len(path) - 1, 0), 4)} `{name}`\n")
    description = parser.description or help_text
    if description:
        out.append(_cell(_sentence(description)) + "\n")
    out.append("```\n" + _usage(parser, name) + "\n```\n")
    for title, actions in _groups(parser):
        out.append(f"{title}:\n")
        out.append(_table(actions))
    sub = _subparsers(parser)
    if sub is None:
        return
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    out.append("Commands:\n")
    rows = ["| command | what it does |", "|---|---|"]
    for child in sub.choices:
        rows.append(f"| `{child}` | {_cell(helps.get(child) or '')} |")
    out.append("\n".join(rows) + "\n")
    for child, child_parser in sub.choices.items():
        _parser_section(out, child_parser, [*path, child], helps.get(child))


def _documented(action: argparse.Action) -> bool:
    return not isinstance(action, argparse._HelpAction | argparse._SubParsersAction) \
        and action.help is not argparse.SUPPRESS


def _groups(parser: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """(title, actions) per argument group that documents anything, in the parser's order."""
    groups = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if _documented(a)]
        if not actions:
            continue
        title = group.title or "options"
        if title == "positional arguments":
            title = "Arguments"
        elif title in ("options", "optional arguments"):
            title = "Options"
        else:
            title = f"Options ({title})"
        groups.append((title, actions))
    return groups


def _metavar(action: argparse.Action) -> str:
    if action.metavar is not None:
        return str(action.metavar)
    if action.choices is not None:
        return "{" + ",".join(str(c) for c in action.choices) + "}"
    return action.dest if not action.option_strings else action.dest.upper()


def _takes_value(action: argparse.Action) -> bool:
    return action.nargs != 0


def _usage_part(action: argparse.Action) -> str:
    if isinstance(action, argparse._SubParsersAction):
        return f"{_metavar(action)} ..."
    if not action.option_strings:
        return _metavar(action)
    flag = max(action.option_strings, key=len)
    part = f"{flag} {_metavar(action)}" if _takes_value(action) else flag
    return part if action.required else f"[{part}]"


def _usage(parser: argparse.ArgumentParser, name: str) -> str:
    optionals = [a for a in parser._actions
                 if a.option_strings and not isinstance(a, argparse._HelpAction)]
    positionals = [a for a in parser._actions if not a.option_strings]
    parts = [_usage_part(a) for a in optionals + positionals
             if a.help is not argparse.SUPPRESS or isinstance(a, argparse._SubParsersAction)]
    lines, line = [], name
    for part in parts:
        if len(line) + 1 + len(part) > WIDTH and line.strip():
            lines.append(line)
            line = " " * 4 + part
        else:
            line = f"{line} {part}"
    lines.append(line)
    return "\n".join(lines)


def _default(action: argparse.Action) -> str:
    value = action.default
    if value is None or value is argparse.SUPPRESS:
        return ""
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return ""
    if isinstance(value, list | tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if "%(" in text:  # argparse's own expansion of %(default)s and friends
        params = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
        if action.choices is not None:
            params["choices"] = ", ".join(str(c) for c in action.choices)
        text = text % params
    return text


def _table(actions: list[argparse.Action]) -> str:
    rows = ["| argument | default | description |", "|---|---|---|"]
    for action in actions:
        if action.option_strings:
            flags = ", ".join(action.option_strings)
            name = f"{flags} {_metavar(action)}" if _takes_value(action) else flags
        else:
            name = _metavar(action)
        notes = []
        if isinstance(action, argparse._AppendAction):
            notes.append("repeatable")
        if action.required and action.option_strings:
            notes.append("required")
        name = _code(name) + (f" ({', '.join(notes)})" if notes else "")
        default = _default(action)
        rows.append(f"| {name} | {_code(default) if default else ''} | "
                    f"{_cell(_help(action))} |")
    return "\n".join(rows) + "\n"


def _sentence(text: str) -> str:
    text = " ".join(text.split())
    return text[:1].upper() + text[1:] + ("" if text.endswith((".", ")", ":")) else ".")


def _code(text: str) -> str:
    """A code span in a table cell: only a pipe needs escaping there (GFM splits cells first)."""
    return "`" + " ".join(text.split()).replace("|", "\\|") + "`"


def _cell(text: str) -> str:
    """One line of a Markdown table cell: a pipe would end the cell (even in a code span) and
    <word> would be read as an HTML tag."""
    text = " ".join(text.split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


if __name__ == "__main__":
    import sys

    sys.stdout.write(render())
