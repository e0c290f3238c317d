"""Numeric answers the MGSM way: the last number of an output, compared exactly.

MGSM's scorer takes the last number in the model's output, drops thousands commas and
trailing decimal zeros, and compares the string with the gold answer. We do the same
with two deliberate additions: a leading minus is part of the number (unless it joins
two words or numbers, as in ``10-12``), and the gold answer is normalised the same way
(``1,000`` and ``1000.0`` are both ``1000``).

Torch-free: the API checks gold answers with :func:`parse_number` at submission.
"""

from __future__ import annotations

import re

# A comma between digits is a thousands separator (MGSM removes every such comma, so
# a European decimal comma "3,5" reads as 35, as it does there).
_THOUSANDS = re.compile(r"(?<=\d),(?=\d)")
# A minus is a sign only when it does not follow a word character or another minus:
# "x = -5" is -5, "pages 10-12" ends with 12.
_NUMBER = re.compile(r"(?:(?<![\w-])-)?\d+(?:\.\d+)?")
_WHOLE = re.compile(r"-?\d+(?:\.\d+)?")
# Typographic minus and dashes models print in place of "-".
_MINUSES = str.maketrans({"\u2212": "-", "\u2013": "-", "\ufe63": "-", "\uff0d": "-"})


def _canonical(number: str) -> str:
    """``-0012.500`` -> ``-12.5``; ``3.0`` -> ``3``; ``-0`` -> ``0``."""
    sign = "-" if number.startswith("-") else ""
    digits = number.lstrip("-")
    whole, _, frac = digits.partition(".")
    whole = whole.lstrip("0") or "0"
    frac = frac.rstrip("0")
    out = f"{whole}.{frac}" if frac else whole
    return "0" if out == "0" else sign + out


def parse_number(text: str) -> str | None:
    """The canonical form of a gold answer (``"1,000"``, ``"-3"``, ``"2.50"``), or None
    when ``text`` is not one number."""
    cleaned = _THOUSANDS.sub("", text.strip().translate(_MINUSES))
    if not _WHOLE.fullmatch(cleaned):
        return None
    return _canonical(cleaned)


def extract_answer(output: str) -> str | None:
    """The last number in ``output``, canonical, or None when there is none."""
    found = _NUMBER.findall(_THOUSANDS.sub("", output.translate(_MINUSES)))
    return _canonical(found[-1]) if found else None


def is_correct(extracted: str | None, gold: str) -> bool:
    """Exact match of canonical forms; ``gold`` must already be canonical."""
    return extracted is not None and extracted == gold
