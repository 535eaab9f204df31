"""NATS subjects: dot-separated tokens, ``*`` matching one token and ``>`` the rest."""

from __future__ import annotations


def matches(pattern: str, subject: str) -> bool:
    """Whether the literal ``subject`` falls under ``pattern`` (which may hold wildcards)."""
    wanted, given = pattern.split("."), subject.split(".")
    for index, token in enumerate(wanted):
        if token == ">":
            return len(given) > index
        if index >= len(given) or (token != "*" and token != given[index]):
            return False
    return len(wanted) == len(given)


def overlap(first: str, second: str) -> bool:
    """Whether some literal subject falls under both patterns."""
    a, b = first.split("."), second.split(".")
    for index in range(min(len(a), len(b))):
        if a[index] == ">" or b[index] == ">":
            return True
        if a[index] != b[index] and "*" not in (a[index], b[index]):
            return False
    return len(a) == len(b)


def is_valid(subject: str, wildcards: bool) -> bool:
    """Whether ``subject`` is well formed: no empty token, no whitespace, wildcards only where
    allowed (``>`` only last)."""
    if not subject or any(c.isspace() for c in subject):
        return False
    tokens = subject.split(".")
    for index, token in enumerate(tokens):
        if not token:
            return False
        if token in ("*", ">") and not wildcards:
            return False
        if token == ">" and index != len(tokens) - 1:
            return False
    return True
