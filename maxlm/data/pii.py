"""PII scrubbing: personal identifiers become placeholders, ordinary numbers stay.

    <EMAIL>        e-mail addresses
    <ID_NUMBER>    mainland-China resident ID numbers (18 characters; birth date and the ISO 7064
                   MOD 11-2 check character must be valid)
    <CARD_NUMBER>  payment-card-like numbers: 13-19 digits, optionally grouped by spaces or hyphens,
                   a known issuer prefix (Visa, Mastercard, Amex, Discover, JCB, UnionPay, Diners)
                   and a valid Luhn checksum
    <IP_ADDRESS>   IPv4 and IPv6 addresses (validated by the ipaddress module)
    <PHONE>        international numbers written with + (8-15 digits), mainland-China mobiles
                   (1[3-9]x xxxx xxxx, optional +86) and landlines (0xx(x)-xxxxxxx(x)), and North
                   American numbers written (415) 555-2671, 415-555-2671 or 415.555.2671

The checks that make these precise (check digits, issuer prefixes, separators, digit boundaries)
are what keep years, prices, dates, versions, ports and line numbers in code intact. The patterns
are ASCII-bounded, so an identifier glued to Chinese text (``电话13812345678``) is still found.
Known misses: old 15-digit ID numbers, phone numbers written without any separator outside China,
and numbers that are split by words.
"""

from __future__ import annotations

import collections
import datetime
import ipaddress
import re

PLACEHOLDERS = {"email": "<EMAIL>", "id_number": "<ID_NUMBER>", "card": "<CARD_NUMBER>",
                "ip": "<IP_ADDRESS>", "phone": "<PHONE>"}

# E-mail addresses are found from their "@": the domain by a regex anchored there, the local part by
# scanning back over its characters (far faster than trying a local-part pattern at every letter).
_EMAIL_DOMAIN = re.compile(r"@((?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+[A-Za-z]{2,24})(?![A-Za-z0-9-])")
_EMAIL_LOCAL = re.compile(r"[A-Za-z0-9._%+-]{1,64}\Z")
_CN_ID = re.compile(r"(?=[1-9])(?<![0-9A-Za-z])[1-9]\d{5}(?:18|19|20)\d{2}(?:0[1-9]|1[0-2])"
                    r"(?:0[1-9]|[12]\d|3[01])\d{3}[0-9Xx](?![0-9A-Za-z])")
_CARD = re.compile(r"(?=\d)(?<![\d.,-])(?:\d{4}([ -])\d{4}\1\d{4}\1\d{4}(?:\1\d{3})?|"  # 4-4-4-4(-3)
                   r"\d{4}([ -])\d{6}\2\d{4,5}|"  # 4-6-5 (Amex), 4-6-4 (Diners)
                   r"\d{13,19})(?![\d-]|[.,]\d)")
_IPV4 = re.compile(r"(?=\d)(?<![\d.])(?:(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}"
                   r"(?:25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)(?!\.?\d)")
_IPV6 = re.compile(r"(?=[0-9A-Fa-f:])(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}"
                   r"(?:(?<=:)(?:\d{1,3}\.){3}\d{1,3})?(?![\w:])")
_PHONE_INTL = re.compile(r"(?=\+)(?<![\w+])\+[1-9]\d{0,2}[ .-]?(?:\(\d{1,4}\)[ .-]?)?\d{1,4}"
                         r"(?:[ .-]?\d{2,4}){1,5}(?![\d])")
_PHONE_CN_MOBILE = re.compile(r"(?=[+01])(?<![\d+])(?:(?:\+|00)86[ -]?)?1[3-9]\d(?:[ -]?\d{4}){2}(?!\d)")
_PHONE_CN_LAND = re.compile(r"(?=[+0(])(?<![\d+])(?:(?:\+|00)86[ -]?)?(?:\(0\d{2,3}\)[ -]?|0\d{2,3}[ -])"
                            r"[2-9]\d{6,7}(?!\d)")
_PHONE_NANP = re.compile(r"(?=[(2-9])(?<![\w(+.-])(?:\([2-9]\d{2}\) ?|[2-9]\d{2}[.-])[2-9]\d{2}[.-]\d{4}(?![\d])")

# Each pattern opens with a lookahead on its first character: it lets the regex engine skip ahead
# to candidate positions instead of testing the lookbehind everywhere (3-5x faster).
_ID_WEIGHTS = (7, 9, 10, 5, 8, 4, 2, 1, 6, 3, 7, 9, 10, 5, 8, 4, 2)
_ID_CHECK = "10X98765432"
# Issuer prefixes and the lengths their numbers have.
_CARD_BRANDS = ((("4",), (13, 16, 19)), (("51", "52", "53", "54", "55"), (16,)), (("34", "37"), (15,)),
                (("6011", "644", "645", "646", "647", "648", "649", "65"), (16, 17, 18, 19)),
                (("35",), (16, 17, 18, 19)), (("62",), (16, 17, 18, 19)), (("30", "36", "38"), (14, 16)))


def valid_cn_id(number: str) -> bool:
    """Birth date and ISO 7064 MOD 11-2 check character of an 18-character resident ID."""
    if len(number) != 18 or not number[:17].isdigit():
        return False
    try:
        datetime.date(int(number[6:10]), int(number[10:12]), int(number[12:14]))
    except ValueError:
        return False
    total = sum(int(d) * w for d, w in zip(number[:17], _ID_WEIGHTS))
    return _ID_CHECK[total % 11] == number[17].upper()


def luhn_ok(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = ord(ch) - 48
        if i % 2:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card_like(match: str) -> bool:
    digits = re.sub(r"\D", "", match)
    if len(digits) == 16 and 2221 <= int(digits[:4]) <= 2720:  # Mastercard's 2-series
        return luhn_ok(digits)
    for prefixes, lengths in _CARD_BRANDS:
        if digits.startswith(prefixes) and len(digits) in lengths:
            return luhn_ok(digits)
    return False


def _ipv6_ok(match: str) -> bool:
    groups = [g for g in match.split(":") if g]
    if len(groups) < 2 or "." not in match and max(len(g) for g in groups) < 2:
        return False  # x[::2], a::b and the like in code
    try:
        ipaddress.IPv6Address(match)
    except ValueError:
        return False
    return True


def _phone_digits_ok(match: str) -> bool:
    digits = sum(ch.isdigit() for ch in match)
    separated = any(ch in " .-(" for ch in match)
    return (8 if separated else 10) <= digits <= 15  # "+99585767" alone is more likely a number


_ZEROS = str.maketrans("123456789", "000000000")
_IPV4_GATE = re.compile(r"0\.0{1,3}\.0{1,3}\.0")
_IPV6_GATE = re.compile(r":[0-9A-Fa-f]{1,4}:[0-9A-Fa-f]{1,4}:[0-9A-Fa-f]{1,4}:")

# (kind, gate, pattern, validator) in the order applied: the most specific shapes first, so a card
# or ID number is never half-eaten by the phone patterns. The gate is a cheap test that the document
# must pass before the (slower) pattern runs over it; ``z`` is the text with every digit made "0",
# so most gates are plain substring searches.
_RULES = (
    ("email", lambda t, z: "@" in t, _EMAIL_DOMAIN, None),
    ("id_number", lambda t, z: "0" * 17 in z, _CN_ID, valid_cn_id),
    ("card", lambda t, z: "0" * 13 in z or "0000 0000" in z or "0000-0000" in z, _CARD, _card_like),
    ("ip", lambda t, z: "0.0" in z and _IPV4_GATE.search(z) is not None, _IPV4, None),
    ("ip", lambda t, z: "::" in t or _IPV6_GATE.search(t) is not None, _IPV6, _ipv6_ok),
    ("phone", lambda t, z: "+0" in z, _PHONE_INTL, _phone_digits_ok),
    ("phone", lambda t, z: "0000" in z, _PHONE_CN_MOBILE, None),
    ("phone", lambda t, z: "000-" in z or "000 " in z or "0)" in z, _PHONE_CN_LAND, None),
    ("phone", lambda t, z: "000-0000" in z or "000.0000" in z, _PHONE_NANP, None),
)


def _scrub_emails(text: str, counts: collections.Counter) -> str:
    pieces, last = [], 0
    for m in _EMAIL_DOMAIN.finditer(text):
        at = m.start()
        if at < last:
            continue
        local = _EMAIL_LOCAL.search(text, max(last, at - 64), at)
        if local is None:
            continue
        start = local.start()
        while start < at and not text[start].isalnum():  # ".", "%", "+" or "-" cannot open it
            start += 1
        if start == at or (start > 0 and re.match(r"[A-Za-z0-9._%+-]", text[start - 1])):
            continue  # nothing before "@", or a local part longer than 64 characters
        pieces.append(text[last:start])
        pieces.append(PLACEHOLDERS["email"])
        counts["email"] += 1
        last = m.end()
    if not pieces:
        return text
    pieces.append(text[last:])
    return "".join(pieces)


def scrub(text: str) -> tuple[str, collections.Counter]:
    """(text with PII replaced by placeholders, count of replacements by kind)."""
    counts: collections.Counter = collections.Counter()
    zeros = text.translate(_ZEROS)
    for kind, gate, pattern, valid in _RULES:
        if not gate(text, zeros):
            continue
        if kind == "email":
            text = _scrub_emails(text, counts)
            continue
        placeholder = PLACEHOLDERS[kind]

        def replace(m, kind=kind, valid=valid, placeholder=placeholder):
            if valid is not None and not valid(m.group(0)):
                return m.group(0)
            counts[kind] += 1
            return placeholder
        text = pattern.sub(replace, text)
    return text, counts
