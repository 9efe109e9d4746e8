"""Argument checks shared by the GPU tools: --help prints the tool's docstring, and a missing or
malformed positional argument or integer flag, or a flag the tool does not take, exits with the usage line before
any weights are made or a GPU is used."""
from __future__ import annotations

import sys


def positional(doc: str, usage: str, required: int, ints: tuple[int, ...] = (),
               flags: tuple[str, ...] = ()) -> list[str]:
    """The command line's positional arguments (those not starting with --), after --help and the checks:
    at least `required` of them, the ones at the indices in `ints` integers, and every --name or --name=value
    one of `flags` (a misspelt flag would otherwise change nothing without a word)."""
    if "-h" in sys.argv[1:] or "--help" in sys.argv[1:]:
        print(doc.strip())
        sys.exit(0)
    unknown = [a for a in sys.argv[1:] if a.startswith("--") and a.split("=", 1)[0] not in flags]
    if unknown:
        sys.exit(f"usage: {usage}  (no flag {unknown[0]!r}; --help explains)")
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) < required or any(i < len(args) and not args[i].isdigit() for i in ints):
        sys.exit(f"usage: {usage}  (--help explains)")
    return args


def int_flag(name: str, default: int, usage: str) -> int:
    """The value of `NAME=N` on the command line (`name` with its dashes; N a positive integer), or `default`;
    exits with the usage line, before any GPU work, where N is not one."""
    text = next((a.split("=", 1)[1] for a in sys.argv if a.startswith(name + "=")), None)
    if text is None:
        return default
    if not text.isdigit() or int(text) < 1:
        sys.exit(f"usage: {usage}  ({name} takes a positive integer, not {text!r}; --help explains)")
    return int(text)
