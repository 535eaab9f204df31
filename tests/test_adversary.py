"""The fault-injection adversary (services/learner/adversary.py): each attack turns an honest
upload into what it says, and an honest unit (``none``) sends what it trained."""

from __future__ import annotations

import numpy as np
import pytest

from services.learner import adversary
from services.learner.adversary import Adversary
from services.learner.core import Upload
from services.orchestration import commands
from services.orchestration.local.settings import UpSettings

RNG = np.random.default_rng(0)
TENSORS = {"a": RNG.standard_normal(100).astype(np.float32), "b": RNG.standard_normal((4, 5))}


def upload(round_: int = 3, steps: int = 10) -> Upload:
    tensors = {k: np.asarray(v, np.float32) for k, v in TENSORS.items()}
    return Upload(0, round_, 2, steps, 640, 3.0, tensors)


def flat(tensors) -> np.ndarray:
    return np.concatenate([np.ravel(tensors[k]) for k in sorted(tensors)])


def norm(tensors) -> float:
    return float(np.linalg.norm(flat(tensors)))


def cosine(x, y) -> float:
    return float(flat(x) @ flat(y) / (norm(x) * norm(y)))


def test_an_honest_unit_sends_what_it_trained() -> None:
    honest = upload()
    assert Adversary("none", 0, 30).upload(honest) is honest
    assert Adversary("none", 0, 30).payload(0, b"p", "d") == (b"p", "d")
    assert adversary.own_h("none", 30) == 30


@pytest.mark.parametrize(
    ("kind", "size", "agreement"),
    [
        ("sign_flip", 1.0, (-1.0, -1.0)),
        ("scaled", adversary.SCALED, (1.0, 1.0)),
        ("random", adversary.RANDOM_SCALE, (-0.3, 0.3)),
        ("alie", None, (0.5, 0.9)),
    ],
)
def test_each_value_attack_has_its_size_and_direction(kind, size, agreement) -> None:
    honest = upload()
    hostile = Adversary(kind, 0, 30).upload(honest)
    assert (hostile.round, hostile.base_version, hostile.inner_steps, hostile.tokens) == (
        3,
        2,
        10,
        640,
    )
    if size is not None:
        assert norm(hostile.tensors) == pytest.approx(size * norm(honest.tensors), rel=1e-5)
    low, high = agreement
    assert low - 1e-6 <= cosine(hostile.tensors, honest.tensors) <= high + 1e-6


def test_alie_shifts_every_coordinate_down_by_its_size() -> None:
    hostile = Adversary("alie", 0, 30).upload(upload()).tensors
    for k, v in TENSORS.items():
        np.testing.assert_allclose(hostile[k], v - adversary.ALIE_Z * np.abs(v), rtol=1e-6)


def test_replay_sends_each_fragments_first_payload_again() -> None:
    replaying = Adversary("replay", 0, 30)
    assert replaying.payload(0, b"first", "d0") == (b"first", "d0")
    assert replaying.payload(1, b"other", "d1") == (b"other", "d1")
    assert replaying.payload(0, b"second", "d2") == (b"first", "d0")


def test_too_frequent_uploads_every_eighth_of_a_period_claiming_a_whole_one() -> None:
    assert adversary.own_h("too_frequent", 30) == 30 // adversary.FREQUENCY
    claimed = Adversary("too_frequent", 0, 30).upload(upload(steps=3))
    assert claimed.inner_steps == 30 and claimed.tokens == 640 * 10


def test_diloco_up_makes_the_first_units_adversaries() -> None:
    settings = UpSettings(learners=4, adversaries=2, adversary="alie")
    args = [commands.learner_args(settings, "nats://x", unit) for unit in range(4)]
    assert [a[-2:] == ["--adversary", "alie"] for a in args] == [True, True, False, False]
    with pytest.raises(ValueError, match="go together"):
        UpSettings(learners=4, adversaries=1)
    with pytest.raises(ValueError, match="adversaries 5 > learners 4"):
        UpSettings(learners=4, adversaries=5, adversary="random")
