"""The README's table of ``kvserve serve``'s options, generated from the parser itself so it cannot go stale.

    python -m kvserve.server.options_table            # print the table
    python -m kvserve.server.options_table --write    # rewrite it in README.md, between its two marker lines

tests/test_cli.py fails while README.md's table differs from what this prints: after changing a flag or its help,
run the ``--write`` command. The words come from each option's ``help`` and its default from
``serve.default_text`` (what ``kvserve serve --help`` prints), grouped as ``--help`` groups them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvserve.server import serve

BEGIN = ("<!-- options table: generated from `kvserve serve --help` by `python -m kvserve.server.options_table --write`; "
         "edit the flags' help in server/serve.py, not here -->")
END = "<!-- end of the options table -->"
README = Path(__file__).resolve().parent.parent / "README.md"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _usage(action: argparse.Action) -> str:
    """``--flag VALUE`` as a reader types it: choices as ``a|b|c``, else the metavar (or the dest in capitals)."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return flag
    if action.choices:
        return f"{flag} {'|'.join(map(str, action.choices))}"
    return f"{flag} {action.metavar or action.dest.upper()}"


def markdown(parser: argparse.ArgumentParser) -> str:
    """The table: a bold row per option group, then one row per option: usage, default, what it does."""
    lines = ["| option | default | what it does |", "|---|---|---|"]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        lines.append(f"| **{group.title.removesuffix(' options')}** | | *{_cell(group.description or '')}* |")
        for action in actions:
            default = serve.default_text(action)
            shown = default if getattr(action, "default_text", None) or action.nargs == 0 else f"`{default}`"
            lines.append(f"| `{_cell(_usage(action))}` | {_cell(shown)} | {_cell(action.help or '')} |")
    return "\n".join(lines)


def serve_parser() -> argparse.ArgumentParser:
    """``kvserve serve``'s parser, as the CLI builds it."""
    parser = argparse.ArgumentParser(prog="kvserve serve")
    serve.add_arguments(parser)
    return parser


def replace_table(text: str, table: str) -> str:
    """``text`` with the lines between the markers (both kept) replaced by ``table``.

    Raises:
        ValueError: the text lacks a marker.
    """
    if BEGIN not in text or END not in text:
        raise ValueError(f"no options table to replace: the file needs the lines {BEGIN!r} and {END!r}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    """Print the table, or with ``--write`` put it into README.md (or ``--file``); returns 0."""
    parser = argparse.ArgumentParser(prog="python -m kvserve.server.options_table", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the table in the file instead of printing it")
    parser.add_argument("--file", type=Path, default=README, help="the file holding the table (default: README.md)")
    args = parser.parse_args(argv)
    table = markdown(serve_parser())
    if not args.write:
        print(table)
        return 0
    text = args.file.read_text()
    updated = replace_table(text, table)
    if updated != text:
        args.file.write_text(updated)
    print(f"{args.file}: options table {'rewritten' if updated != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
