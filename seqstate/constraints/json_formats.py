"""String ``format``s that JSON generation enforces, and the checker that validates them.

Each enforced format is one regex, used twice: as a ``pattern`` in the grammar that generates
the string, and with ``re.fullmatch`` when the finished value is validated.  Every regex is an
ASCII subset of the format's RFC syntax, so a generated string is always valid even where the
RFC allows more (IPv6 literals in URIs, leap seconds, quoted e-mail local parts).  Formats not
listed here are checked at validation only when ``jsonschema`` knows them, and are otherwise
annotations, as the JSON Schema specification says of unknown formats.
"""

from __future__ import annotations

import re

import jsonschema

__all__ = ["FORMATS", "ALIASES", "format_regex", "format_checker"]

_YEAR = r"(?:[1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"     # 0001-9999, as Python dates
_LEAP = r"(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
_DATE = (rf"(?:{_YEAR}-(?:(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
         r"|(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)|02-(?:0[1-9]|1[0-9]|2[0-8]))"
         rf"|{_LEAP}-02-29)")
# RFC 3339 full-time without leap seconds: a second "60" is valid only at a real leap second
_TIME = (r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\.[0-9]{1,9})?"
         r"(?:Z|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])")
_DUR_TIME = r"T(?:[0-9]+H(?:[0-9]+M)?(?:[0-9]+S)?|[0-9]+M(?:[0-9]+S)?|[0-9]+S)"
_DURATION = (rf"P(?:(?:[0-9]+Y(?:[0-9]+M)?(?:[0-9]+D)?|[0-9]+M(?:[0-9]+D)?|[0-9]+D)(?:{_DUR_TIME})?"
             rf"|{_DUR_TIME}|[0-9]+W)")
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = rf"{_LABEL}(?:\.{_LABEL})*"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = rf"{_OCTET}(?:\.{_OCTET}){{3}}"
_H16 = r"[0-9A-Fa-f]{1,4}"
_IPV6 = "|".join([
    rf"(?:{_H16}:){{7}}{_H16}",
    rf"(?:{_H16}:){{1,7}}:",
    rf"(?:{_H16}:){{1,6}}:{_H16}",
    *(rf"(?:{_H16}:){{1,{6 - k}}}(?::{_H16}){{1,{k + 1}}}" for k in range(1, 6)),
    rf":(?::{_H16}){{1,7}}",
    "::",
])
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_EMAIL = rf"{_ATEXT}+(?:\.{_ATEXT}+)*@{_LABEL}(?:\.{_LABEL})*"
_UUID = r"[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}"
# RFC 3986 URIs without IP-literal hosts
_PCT = r"%[0-9A-Fa-f]{2}"
_PCHAR = rf"(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|{_PCT})"
_PCHAR_NC = rf"(?:[A-Za-z0-9._~!$&'()*+,;=@-]|{_PCT})"                  # no colon
_AUTHORITY = (rf"(?:(?:[A-Za-z0-9._~!$&'()*+,;=:-]|{_PCT})*@)?"
              rf"(?:[A-Za-z0-9._~!$&'()*+,;=-]|{_PCT})*(?::[0-9]*)?")
_TAIL = rf"(?:\?(?:{_PCHAR}|[/?])*)?(?:#(?:{_PCHAR}|[/?])*)?"
_ABEMPTY = rf"(?:/{_PCHAR}*)*"
_ABSOLUTE = rf"/(?:{_PCHAR}+{_ABEMPTY})?"
_URI = (rf"[A-Za-z][A-Za-z0-9+.-]*:(?://{_AUTHORITY}{_ABEMPTY}|{_ABSOLUTE}|{_PCHAR}+{_ABEMPTY}|)"
        rf"{_TAIL}")
_RELATIVE = rf"(?://{_AUTHORITY}{_ABEMPTY}|{_ABSOLUTE}|{_PCHAR_NC}+{_ABEMPTY}|){_TAIL}"

FORMATS: dict[str, str] = {
    "date": _DATE,
    "time": _TIME,
    "date-time": rf"{_DATE}T{_TIME}",
    "duration": _DURATION,
    "email": _EMAIL,
    "hostname": _HOSTNAME,
    "ipv4": _IPV4,
    "ipv6": rf"(?:{_IPV6})",
    "uuid": _UUID,
    "uri": _URI,
    "uri-reference": rf"(?:{_URI}|{_RELATIVE})",
    "json-pointer": r"(?:/(?:[^~/]|~[01])*)*",
    "byte": r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?",
}

# Other names in common use for the formats above; each generates a subset of its own format
ALIASES: dict[str, str] = {
    "url": "uri", "iri": "uri", "iri-reference": "uri-reference", "full-date": "date",
    "idn-email": "email",
}

_MAX_LENGTH = {"hostname": 253, "email": 254}     # RFC 1034 and RFC 5321 bounds on the whole


def format_regex(name: str) -> tuple[str, int | None] | None:
    """``(regex, max_length)`` that generates format ``name``, or None if it is not enforced."""
    name = ALIASES.get(name, name)
    if name not in FORMATS:
        return None
    return FORMATS[name], _MAX_LENGTH.get(name)


def _matcher(name: str):
    compiled = re.compile(FORMATS[ALIASES.get(name, name)])
    bound = _MAX_LENGTH.get(ALIASES.get(name, name))

    def check(value: object) -> bool:
        if not isinstance(value, str):
            return True                                   # formats constrain strings only
        if bound is not None and len(value) > bound:
            return False
        return compiled.fullmatch(value) is not None

    return check


def format_checker(validator_cls) -> jsonschema.FormatChecker:
    """A checker for ``validator_cls``'s draft: ``jsonschema``'s own checks, and then ours.

    A value of an enforced format must pass both, so validation is never laxer than
    ``jsonschema``'s where it has a check of its own.
    """
    base = validator_cls.FORMAT_CHECKER
    checker = jsonschema.FormatChecker(formats=())
    checker.checkers = dict(base.checkers)
    for name in (*FORMATS, *ALIASES):
        ours = _matcher(name)
        theirs = base.checkers.get(name)

        def both(value, ours=ours, theirs=theirs):
            if theirs is not None:
                func, raises = theirs
                try:
                    if not func(value):
                        return False
                except raises:
                    return False
            return ours(value)

        checker.checkers[name] = (both, (ValueError,))
    return checker
