"""Counter names and rejection reasons are each one ``Literal`` vocabulary
(``shared/unit_counters.py``, ``services/outer/errors.py``). Nothing runs a type checker on
every change, so a static scan of the code finds every name that is counted or read, and checks
it against the vocabulary: a misspelt name fails here. The other way round, every name of a
vocabulary must be counted somewhere in the services, so that none outlives its counter.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.gateway.collector import UNIT_COUNTERS
from services.learner.counters import Counters
from services.outer.errors import REJECTION_REASONS
from shared.unit_counters import COUNTER_NAMES, LIFETIME_COUNTERS
from tests.helpers import REPO

SCANNED = ("services", "shared", "sim", "bench", "tests")


def python_files() -> Iterator[Path]:
    for folder in SCANNED:
        yield from sorted((REPO / folder).rglob("*.py"))


TREES = {
    path.relative_to(REPO).as_posix(): ast.parse(path.read_text())
    for path in python_files()
    if path != Path(__file__)  # this file misspells names on purpose
}


def text(node: ast.AST) -> str:
    return ast.unparse(node)


def literal(node: ast.AST | None) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def strings(node: ast.AST) -> list[str]:
    """The string keys or members of a dict, set, list or tuple literal."""
    if isinstance(node, ast.Dict):
        items = node.keys
    elif isinstance(node, ast.Set | ast.List | ast.Tuple):
        items = node.elts
    else:
        return []
    return [value for item in items if (value := literal(item)) is not None]


#: Calls that count or read a counter: (method, what the receiver's name ends with, the index
#: of the argument that names the counter).
COUNTER_CALLS = (
    ("add", "counters", 0),  # Counters.add
    ("count", "link", 0),  # LearnerLink.count
    ("_count", "", 0),  # CheckpointWriter._count
    ("counter", "", 0),  # UnitStatus.counter
    ("record", "unit_state", 0),  # UnitState.record
    ("_finish", "", 1),  # Sender._finish
)

#: What the names of dicts keyed by counter names end with.
COUNTER_DICTS = ("counters", "lifetime", "life")


def counter_names(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of every counter name the code counts or reads: a ``COUNTER_CALLS``
    call, or ``...counters[name]``, ``...lifetime[name]`` (also as an assignment target)."""
    for node in ast.walk(tree):
        named: list[ast.expr] = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            method, receiver = node.func.attr, text(node.func.value)
            named = [
                node.args[index]
                for called, owner, index in COUNTER_CALLS
                if method == called and receiver.endswith(owner) and len(node.args) > index
            ]
        elif isinstance(node, ast.Subscript) and text(node.value).endswith(COUNTER_DICTS):
            named = [node.slice]
        for name_node in named:
            if (name := literal(name_node)) is not None:
                yield node.lineno, name


def rejection_reasons(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``(line, reason)`` of every reason raised, counted or compared: ``Rejected(reason, ...)``,
    ``ledger.reject(reason, ...)``, ``rejected.reason`` or a ``pytest.raises`` value's
    ``.reason`` compared with a reason (or ``in {...}``), and the keys of a dict compared with
    ``....rejected``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            called = text(node.func)
            reason = literal(node.args[0]) if node.args else None
            if (called == "Rejected" or called.endswith("ledger.reject")) and reason is not None:
                yield node.lineno, reason
        elif isinstance(node, ast.Compare):
            left = text(node.left)
            for right in node.comparators:
                if left.endswith(("value.reason", "rejected.reason")):
                    found = [r] if (r := literal(right)) is not None else strings(right)
                elif "rejected" in left:
                    found = strings(right)
                else:
                    continue
                yield from ((node.lineno, reason) for reason in found)


def found(scan, where: tuple[str, ...] = SCANNED) -> dict[str, list[str]]:
    """Every name ``scan`` finds, with the places it was found."""
    names: dict[str, list[str]] = {}
    for path, tree in TREES.items():
        if path.startswith(where):
            for line, name in scan(tree):
                names.setdefault(name, []).append(f"{path}:{line}")
    return names


@dataclass(frozen=True)
class Vocabulary:
    """One vocabulary: its names, where it is defined, the scan that finds its uses, the folder
    that must use every name, and names the scan must find (so that it cannot go blind)."""

    names: tuple[str, ...]
    defined_in: str
    scan: Callable[[ast.AST], Iterator[tuple[int, str]]]
    emitted_in: str
    seen: frozenset[str]


VOCABULARIES = {
    "counters": Vocabulary(
        COUNTER_NAMES,
        "shared.unit_counters.CounterName",
        counter_names,
        "services/learner",
        # Readers too: the gateway, diloco up's progress line, the tests.
        frozenset({"published", "bytes_sent", "records_rejected"}),
    ),
    "rejections": Vocabulary(
        REJECTION_REASONS,
        "services.outer.errors.RejectionReason",
        rejection_reasons,
        "services/outer",
        frozenset({"too_stale", "bad_envelope", "norm_outlier"}),
    ),
}


@pytest.mark.parametrize("vocabulary", VOCABULARIES.values(), ids=VOCABULARIES.keys())
def test_every_name_counted_read_or_compared_is_in_its_vocabulary(vocabulary):
    names = found(vocabulary.scan)
    unknown = {name: places for name, places in names.items() if name not in vocabulary.names}
    assert not unknown, f"not in {vocabulary.defined_in}: {unknown}"
    assert vocabulary.seen <= set(names)


@pytest.mark.parametrize("vocabulary", VOCABULARIES.values(), ids=VOCABULARIES.keys())
def test_every_name_of_a_vocabulary_is_counted_by_its_service(vocabulary):
    emitted = found(vocabulary.scan, (vocabulary.emitted_in,))
    assert set(vocabulary.names) == set(emitted), set(vocabulary.names) ^ set(emitted)


def test_the_lifetime_counters_and_the_prometheus_counters_are_counter_names():
    assert set(LIFETIME_COUNTERS) <= set(COUNTER_NAMES)
    assert {name for name, _metric, _help in UNIT_COUNTERS} <= set(COUNTER_NAMES)


def test_counting_an_unknown_name_fails():
    counters = Counters()
    counters.add("published")
    with pytest.raises(ValueError, match="unknown counter 'publishd'"):
        counters.add("publishd")  # type: ignore[arg-type]
    assert counters.as_dict() == {"published": 1}


def test_the_scan_sees_a_misspelt_name():
    tree = ast.parse(
        "link.counters.add('publishd')\nstatus.counter('bytes_snt')\n"
        "raise Rejected('too_stail', 'x')\nassert status.rejected == {'bad_envelop': 1}\n"
        "assert err.value.reason == 'wrong_jobb'\n"
    )
    assert [name for _, name in counter_names(tree)] == ["publishd", "bytes_snt"]
    assert sorted(name for _, name in rejection_reasons(tree)) == [
        "bad_envelop",
        "too_stail",
        "wrong_jobb",
    ]
