"""The check characters of the two national codes a document carries, as their standards define them.

* Resident identity number (GB 11643-1999): 17 digits (region, birth date, sequence; an odd sequence is
  a man) and a check character by ISO 7064 MOD 11-2 over them, ``X`` standing for 10.
* Unified social credit code (GB 32100-2015): 18 characters of the alphabet without I, O, Z, S, V; its
  9-character organisation code (positions 9-17) carries its own check (GB 11714-1997, MOD 11, ``X`` for
  10), and the last character is a MOD 31 check over the first 17.

A forged document of the generator has a wrong last character; the extraction stage reports whether a
code read from a document passes (``code_valid``) and the rules reject one that does not.
"""

from __future__ import annotations

import re
from datetime import date

_ID_WEIGHTS = tuple(pow(2, 17 - i, 11) for i in range(17))
_ID_CHECK = "10X98765432"  # index: (sum of weighted digits) mod 11
ID_NUMBER = re.compile(r"^\d{17}[\dX]$")

USCC_ALPHABET = "0123456789ABCDEFGHJKLMNPQRTUWXY"
_USCC_WEIGHTS = (1, 3, 9, 27, 19, 26, 16, 17, 20, 29, 25, 13, 8, 24, 10, 30, 28)
_ORG_WEIGHTS = (3, 7, 9, 10, 5, 8, 4, 2)
USCC = re.compile(rf"^[{USCC_ALPHABET}]{{18}}$")


def id_check_char(first17: str) -> str:
    """The ISO 7064 MOD 11-2 check character of the first 17 digits of an identity number."""
    return _ID_CHECK[sum(int(d) * w for d, w in zip(first17, _ID_WEIGHTS, strict=True)) % 11]


def id_number_valid(number: str) -> bool:
    """An 18-character identity number whose check character and birth date are right."""
    if not ID_NUMBER.match(number):
        return False
    try:
        date(int(number[6:10]), int(number[10:12]), int(number[12:14]))
    except ValueError:
        return False
    return id_check_char(number[:17]) == number[17]


def _org_check_char(first8: str) -> str:
    value = 11 - sum(USCC_ALPHABET.index(c) * w for c, w in zip(first8, _ORG_WEIGHTS, strict=True)) % 11
    return {10: "X", 11: "0"}.get(value, str(value))


def uscc_check_char(first17: str) -> str:
    """The MOD 31 check character of the first 17 characters of a unified social credit code."""
    total = sum(USCC_ALPHABET.index(c) * w for c, w in zip(first17, _USCC_WEIGHTS, strict=True))
    return USCC_ALPHABET[(31 - total % 31) % 31]


def uscc_with_checks(registration: str, division: str, organisation8: str) -> str:
    """A complete code from its parts: the organisation code's check, then the code's own."""
    body = registration + division + organisation8 + _org_check_char(organisation8)
    return body + uscc_check_char(body)


def uscc_valid(code: str) -> bool:
    """An 18-character unified social credit code whose two check characters are right."""
    if not USCC.match(code):
        return False
    return _org_check_char(code[8:16]) == code[16] and uscc_check_char(code[:17]) == code[17]
