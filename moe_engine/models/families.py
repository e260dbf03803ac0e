"""The README's families table, written from the registry: one row per registered
architecture, from its class's `card` (`models.spec.FamilyCard`), plus the architectures
refused with their reason.

    python -m moe_engine.models.families            # print the Markdown table
    python -m moe_engine.models.families --check README.md   # exit 1 when README's differs
    python -m moe_engine.models.families --write README.md   # replace README's table

The README holds the table between `BEGIN` and `END` (tests/test_families_table.py checks it
equals this output, so the table cannot drift from the code).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from moe_engine.models import ARCHITECTURES, REFUSED_ARCHITECTURES, architecture_class
from moe_engine.models.spec import FamilyCard

BEGIN = "<!-- families table: python -m moe_engine.models.families -->"
END = "<!-- end of families table -->"

_HEADER = (
    "| family | architecture (`config.json`) | examples | attention | KV cache | "
    "4-bit experts | EP | speculation |\n|---|---|---|---|---|---|---|---|"
)


def card_of(arch: str) -> FamilyCard:
    """The registered class's card.

    Raises:
        KeyError: `arch` is not registered; ValueError: its class has no card.
    """
    card = architecture_class(arch).__dict__.get("card")  # its own, never a base family's
    if card is None:
        raise ValueError(f"{arch} ({ARCHITECTURES[arch]}) has no `card`: add a FamilyCard")
    return card


def _row(arch: str, card: FamilyCard) -> str:
    load_time = ("load-time int4 / mxfp4",) if card.load_time_4bit else ()
    formats = ", ".join((*load_time, *card.native_4bit)) or "none (float experts)"
    examples = ", ".join(f"`{e}`" for e in card.examples)
    spec = ", ".join(card.speculation) or "refused (per-request state)"
    cells = (card.name, f"`{arch}`", examples, card.attention, ", ".join(card.cache), formats,
             "yes", spec)
    return "| " + " | ".join(cells) + " |"


def families_table() -> str:
    """The Markdown table: registered architectures by family name, then a line naming the
    refused ones."""
    rows = sorted(ARCHITECTURES, key=lambda a: (card_of(a).name.lower(), a))
    lines = [_HEADER, *(_row(a, card_of(a)) for a in rows)]
    if REFUSED_ARCHITECTURES:
        refused = ", ".join(f"`{a}`" for a in sorted(REFUSED_ARCHITECTURES))
        lines += ["", f"Refused at startup, naming what the engine lacks for them: {refused}."]
    return "\n".join(lines)


def readme_table(readme: str) -> str:
    """The text between `BEGIN` and `END` in a README, stripped.

    Raises:
        ValueError: a marker is missing.
    """
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README lacks the markers {BEGIN!r} ... {END!r}")
    return readme.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", type=Path, metavar="README",
                        help="exit 1 when this file's table differs from the registry's")
    parser.add_argument("--write", type=Path, metavar="README",
                        help="replace the table between this file's markers")
    args = parser.parse_args(argv)
    table = families_table()
    if args.write is not None:
        text = args.write.read_text()
        old = readme_table(text)
        args.write.write_text(text.replace(old, table, 1))
        return 0
    if args.check is None:
        print(table)
        return 0
    if readme_table(args.check.read_text()) != table:
        print(f"{args.check}: the families table is stale; regenerate it with "
              "`python -m moe_engine.models.families`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
