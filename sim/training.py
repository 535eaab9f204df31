"""Run a whole job in one process on a simulated clock: the quality benchmark's engine.

The same ``LearnerCore`` and ``OuterCore`` that the services run are driven here by an event
queue instead of NATS and wall-clock time, so unit speeds are exact and runs are repeatable and
quick. Unit u's inner step takes ``step_time_s × slowdown_u`` simulated seconds; an upload
reaches the outer, and a published global fragment reaches the units, ``latency_s`` later.
Baselines that share the model, data, inner optimizer and token budget live here too:
data-parallel training and synchronous DiLoCo (arXiv 2311.08105, Algorithm 1).

Every method starts from the same parameters (e.g. a briefly pretrained checkpoint), and every
unit u trains on its own shard with ``BatchSampler(seed, unit=u)``, exactly as a learner does.
The settings are the services' own models (``shared.settings``) with their defaults, so a
simulated run of the defaults is what ``diloco up`` runs; a study changes them with
:func:`changed`.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jax
import numpy as np
from pydantic import BaseModel

from services.learner.core import LearnerCore, dynamic_h
from services.learner.fetch_rule import FetchRule
from services.learner.stagger_rule import stagger_if_slow
from services.learner.trainer import InnerTrainer
from services.outer.core import OuterCore
from services.outer.errors import Rejected
from services.outer.optimizer import make_outer_optimizer, make_outer_step
from services.outer.policy import Arrival
from shared import data, model, pytree
from shared.codec import api as codec
from shared.downlink import Delta, DownlinkSender, Held, Keyframe
from shared.evaluation import EvalResult
from shared.link_spec import LinkSpec
from shared.settings.algorithm import AlgorithmSettings, InnerAlgorithmSettings
from shared.settings.codec import CodecSettings
from shared.settings.workload import DEFAULT_UNITS, WorkloadSettings

SettingsT = TypeVar("SettingsT", bound=BaseModel)


def changed(settings: SettingsT, **changes: Any) -> SettingsT:
    """``settings`` with ``changes``, validated (a study's variant of the shipped settings); the
    fields it sets explicitly are those of ``settings`` and the changes."""
    values = {name: getattr(settings, name) for name in settings.model_fields_set}
    return type(settings).model_validate({**values, **changes})


@dataclass(frozen=True)
class SimSetup:
    """Everything a simulated run shares with the other methods it is compared with: the
    workload, the algorithm and the codecs (the shipped defaults unless changed), the units
    and the simulated clock.

    Attributes:
        workload: model, data order, batch size and each unit's steps (``max_steps``; the
            token budget is ``num_units × max_steps × batch × seq``).
        algorithm: every algorithm setting (the async methods run it; the baselines take its
            inner optimizer, H and outer step).
        codec: the upload and params codecs.
        step_time_s: simulated seconds of one inner step of a unit of slowdown 1.
        latency_s: simulated seconds an upload or a published global takes to arrive, when
            ``link`` is None.
        link: every unit's shaped link (rate each way, one-way delay), as ``diloco up
            --link``: an upload or a copy of the params occupies its direction for its bytes
            over the rate (one after another), then arrives one delay later; a unit fetches the
            newest wanted version whenever no copy is crossing its link (so a slow link skips
            versions). None: every transfer takes ``latency_s``.
        evals: evaluations along the run (plus one at the start and one at the end).
    """

    workload: WorkloadSettings = field(default_factory=WorkloadSettings)
    algorithm: AlgorithmSettings = field(default_factory=AlgorithmSettings)
    codec: CodecSettings = field(default_factory=CodecSettings)
    num_units: int = DEFAULT_UNITS
    step_time_s: float = 0.5
    latency_s: float = 0.25
    link: LinkSpec | None = None
    evals: int = 8

    @property
    def steps_per_unit(self) -> int:
        """Inner steps of each unit (equal speeds)."""
        return self.workload.max_steps

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one inner step of a unit."""
        return self.workload.tokens_per_step()

    @property
    def token_budget(self) -> int:
        """Tokens the whole job trains on."""
        return self.num_units * self.steps_per_unit * self.tokens_per_step


@dataclass
class SimResult:
    """Eval loss along the run and at the end, plus what the outer saw."""

    method: str
    final_eval: float
    curve: list[tuple[int, float]] = field(default_factory=list)  # (tokens, nats/byte)
    outer_steps: int = 0
    staleness: dict[int, int] = field(default_factory=dict)
    merged_per_step: float = 0.0
    merges: list[MergeTrace] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    staggered: list[bool] = field(default_factory=list)  # per unit, at the end
    rejected: dict[str, int] = field(default_factory=dict)  # uploads the outer refused, by reason


@dataclass(frozen=True)
class MergeTrace:
    """One outer step of an asynchronous run: when, which version, the staleness of what went
    into it, and the norms of the change and of the momentum (``MergeResult``)."""

    time_s: float
    version: int
    staleness: tuple[int, ...]
    update_norm: float
    momentum_norm: float


class _Line:
    """One unit's shaped link: a serial line each way (``services/link/pacing.py``'s model)."""

    def __init__(self, link: LinkSpec | None, latency_s: float) -> None:
        self.rate = None if link is None else link.rate_bytes_per_s
        self.delay = latency_s if link is None else link.delay_s
        self.free = {"up": 0.0, "down": 0.0}
        self.bytes = {"up": 0, "down": 0}

    def send(self, direction: str, now: float, nbytes: int) -> float:
        """Send ``nbytes`` from ``now``: when they have all arrived at the other end."""
        self.bytes[direction] += nbytes
        if self.rate is None:
            return now + self.delay
        start = max(now, self.free[direction])
        self.free[direction] = start + nbytes / self.rate
        return self.free[direction] + self.delay


class Workload:
    """Model, data and evaluator shared by every method of one benchmark run."""

    def __init__(
        self, setup: SimSetup, corpus: data.CorpusSplit, evaluate: Callable[[Any], EvalResult]
    ) -> None:
        self.setup = setup
        self.cfg = model.get_config(setup.workload.model)
        self.evaluate = evaluate
        self.shards = [
            data.shard_for_unit(corpus.train, unit, setup.num_units)
            for unit in range(setup.num_units)
        ]
        self.samplers = self._samplers(setup.workload.seed)
        self._trainers: dict[tuple[int, str], InnerTrainer] = {}

    def _samplers(self, seed: int) -> list[data.BatchSampler]:
        batch = self.setup.workload.batch_size
        return [
            data.BatchSampler(shard, self.cfg.seq_len, batch, seed, unit)
            for unit, shard in enumerate(self.shards)
        ]

    def with_seed(self, seed: int) -> Workload:
        """The same workload with another data order (jitted trainers are shared)."""
        other = Workload.__new__(Workload)
        other.__dict__.update(self.__dict__)
        other.setup = dataclasses.replace(
            self.setup, workload=changed(self.setup.workload, seed=seed)
        )
        other.samplers = other._samplers(seed)
        return other

    def trainer(self, horizon: int, inner: InnerAlgorithmSettings | None = None) -> InnerTrainer:
        """An inner trainer whose cosine schedule spans ``horizon`` steps, with the inner
        optimizer of ``inner`` (default: the setup's); cached, as each one compiles."""
        inner = inner or self.setup.algorithm
        key = (horizon, inner.model_dump_json(include=set(InnerAlgorithmSettings.model_fields)))
        if key not in self._trainers:
            self._trainers[key] = InnerTrainer(self.cfg, inner.optimizer(horizon))
        return self._trainers[key]

    def eval_loss(self, params: Any) -> float:
        return float(self.evaluate(params).nats_per_byte)


def pretrain(work: Workload, params: Any, steps: int) -> Any:
    """Single-unit inner steps on unit 0's shard: the shared starting checkpoint."""
    trainer = work.trainer(max(steps, 1))
    state = trainer.init(params)
    workload = work.setup.workload
    sampler = data.BatchSampler(
        work.shards[0], work.cfg.seq_len, workload.batch_size, workload.seed + 10_000, 0
    )
    for step in range(steps):
        state, _ = trainer.step(state, sampler.batch(step))
    return state.params


def _eval_points(setup: SimSetup) -> list[int]:
    return [setup.token_budget * (i + 1) // (setup.evals + 1) for i in range(setup.evals)]


def data_parallel(work: Workload, params: Any) -> SimResult:
    """One synchronous step per batch over all units' data (batch = units × batch size)."""
    s = work.setup
    trainer = work.trainer(s.steps_per_unit)
    state = trainer.init(params)
    points, curve = _eval_points(s), [(0, work.eval_loss(params))]
    for step in range(s.steps_per_unit):
        batch = np.concatenate([sampler.batch(step) for sampler in work.samplers])
        state, _ = trainer.step(state, batch)
        tokens = (step + 1) * s.num_units * s.tokens_per_step
        if points and tokens >= points[0]:
            points.pop(0)
            curve.append((tokens, work.eval_loss(state.params)))
    final = work.eval_loss(state.params)
    curve.append((s.token_budget, final))
    return SimResult("data-parallel", final, curve, s.steps_per_unit)


def sync_diloco(work: Workload, params: Any) -> SimResult:
    """DiLoCo Algorithm 1: every unit takes H steps from the same global, barrier, average,
    outer Nesterov with the setup's outer learning rate and momentum. Unit speeds do not change
    the math (only the wall-clock)."""
    s = work.setup
    algorithm = s.algorithm
    trainer = work.trainer(s.steps_per_unit)
    optimizer = make_outer_optimizer("nesterov", algorithm.outer_lr, algorithm.outer_momentum)
    outer_step = make_outer_step(optimizer)
    global_params, opt_state = params, optimizer.init(params)
    states = [trainer.init(params) for _ in range(s.num_units)]
    points, curve = _eval_points(s), [(0, work.eval_loss(params))]
    step, outer_steps = 0, 0
    while step < s.steps_per_unit:
        h = min(algorithm.h_steps, s.steps_per_unit - step)
        deltas = []
        for unit, state in enumerate(states):
            state = state._replace(params=global_params)
            for k in range(h):
                state, _ = trainer.step(state, work.samplers[unit].batch(step + k))
            states[unit] = state
            deltas.append(jax.tree_util.tree_map(lambda g, p: g - p, global_params, state.params))
        mean = jax.tree_util.tree_map(lambda *d: sum(d) / len(d), *deltas)
        global_params, opt_state, *_ = outer_step(global_params, opt_state, mean)
        outer_steps += 1
        step += h
        tokens = step * s.num_units * s.tokens_per_step
        while points and tokens >= points[0]:
            points.pop(0)
            curve.append((tokens, work.eval_loss(global_params)))
    final = work.eval_loss(global_params)
    curve.append((s.token_budget, final))
    return SimResult("sync DiLoCo", final, curve, outer_steps)


def async_run(
    work: Workload,
    params: Any,
    slowdowns: list[float],
    name: str = "async",
    algorithm: AlgorithmSettings | None = None,
    codec_settings: CodecSettings | None = None,
) -> SimResult:
    """Decoupled DiLoCo on a simulated clock: units never wait; the outer merges by policy.

    Units step until the job has processed the token budget (fast units take more of it); then
    every unit uploads what it has left and the outer merges everything still buffered.
    ``algorithm`` and ``codec_settings`` default to the setup's. Uploads go through the upload
    codec as on the wire, each unit with its own error-feedback state; globals reach a unit in
    the params codec, as the learner fetches them (``params_fetch``, decided by the learner's
    own :class:`~services.learner.fetch_rule.FetchRule`), or with ``params_downlink``
    ``delta`` as the outer's deltas against what each unit holds (``shared.downlink``, the
    same code as the services): over ``setup.link``, a unit fetches the newest wanted version
    whenever nothing is crossing its link, so ``newest`` skips the versions published
    meanwhile; without a link it gets every version.
    """
    s = work.setup
    algorithm = algorithm or s.algorithm
    codec_settings = codec_settings or s.codec
    wire_codec = codec_settings.codec_config()
    params_codec = codec_settings.params_codec
    fragments = algorithm.fragments
    speeds = [1.0 / f for f in slowdowns]
    share = [v / sum(speeds) for v in speeds]
    total_steps = s.num_units * s.steps_per_unit
    named = pytree.flatten_named(params)
    unit_steps = tuple(max(1, round(total_steps * share[u])) for u in range(s.num_units))
    outer = OuterCore(named, algorithm.outer_algorithm(s.num_units, unit_steps))
    rates = {u: speeds[u] for u in range(s.num_units)}
    # With DyLU each unit's H follows its speed from the first round on (speeds are known here).
    unit_h = [
        dynamic_h(algorithm.h_steps, rates[u], rates) if algorithm.dynamic_h else algorithm.h_steps
        for u in range(s.num_units)
    ]
    cores = [
        LearnerCore(
            work.trainer(unit_steps[u], algorithm),
            params,
            algorithm.sync_schedule(fragments, unit_h[u]),
            s.tokens_per_step,
        )
        for u in range(s.num_units)
    ]
    counter = itertools.count()
    events: list[tuple[float, int, str, Any]] = []
    fetch = [
        FetchRule(algorithm.params_fetch, fragments, algorithm.params_fetches_per_period, unit_h[u])
        for u in range(s.num_units)
    ]
    lines = [_Line(s.link, s.latency_s) for _ in range(s.num_units)]
    # The newest published version of each fragment (version, params as a unit decodes them,
    # encoded size), and per unit the fragments whose copy is crossing its link.
    published: list[tuple[int, dict[str, np.ndarray], int] | None] = [None] * fragments
    crossing: list[set[int]] = [set() for _ in range(s.num_units)]
    sent = [[-1] * fragments for _ in range(s.num_units)]  # newest version sent to each unit

    def push(time: float, kind: str, payload: Any) -> None:
        heapq.heappush(events, (time, next(counter), kind, payload))

    # --params-downlink delta: the outer's downlink (shared/downlink.py) and, per unit and
    # fragment, the copy the unit holds; the unit applies what it is sent exactly as the
    # outer recorded it, so the simulation takes the record.
    senders = (
        [DownlinkSender(codec_settings.params_delta_codec) for _ in range(fragments)]
        if codec_settings.params_downlink == "delta"
        else None
    )
    held: list[list[Held | None]] = [[None] * fragments for _ in range(s.num_units)]

    def send_delta(unit: int, fragment: int) -> tuple[Any, int]:
        """What the outer's downlink sends ``unit`` for the newest version: the pieces the
        unit then holds, and the bytes that cross its link (a delta, or the global copy)."""
        assert senders is not None
        sender, copy = senders[fragment], held[unit][fragment]
        answer = sender.answer(unit, *((copy.version, copy.checksum) if copy else (-1, 0)))
        version, pieces, nbytes = published[fragment]  # type: ignore[misc]
        if isinstance(answer, Delta):
            copy = sender.find(unit, answer.version, answer.checksum)
            nbytes = len(answer.payload)
        elif isinstance(answer, Keyframe):
            copy = keyframes[fragment]
        assert copy is not None and copy.version == version
        held[unit][fragment] = copy
        return copy.pieces, nbytes

    def send_global(unit: int, fragment: int, now: float) -> None:
        """Start the newest version towards ``unit`` if it wants it and its link is free."""
        newest = published[fragment]
        rule = fetch[unit]
        if newest is None or fragment in crossing[unit] or not rule.wants(fragment, newest[0]):
            return
        version, pieces, nbytes = newest
        if version <= sent[unit][fragment]:
            return
        sent[unit][fragment] = version
        rule.started(fragment)
        if senders is not None:
            pieces, nbytes = send_delta(unit, fragment)
        rule.fetched(fragment, rule.wanted(fragment))
        if s.link is not None:
            crossing[unit].add(fragment)
        arrives = lines[unit].send("down", now, nbytes)
        push(arrives, "global", (unit, fragment, version, pieces))

    keyframes: list[Held | None] = [None] * fragments

    def publish(now: float) -> None:
        for _, why in outer.settle(now):
            rejected[why.reason] = rejected.get(why.reason, 0) + 1
        for fragment in outer.due(now):
            result = outer.merge(fragment)
            for staleness in result.staleness:
                stats[staleness] = stats.get(staleness, 0) + 1
            merged_sizes.append(len(result.arrivals))
            traces.append(
                MergeTrace(
                    now,
                    result.version,
                    tuple(result.staleness),
                    result.update_norm,
                    result.momentum_norm,
                )
            )
            pieces = outer.fragment_params(fragment)
            exact = {k: np.asarray(v) for k, v in pieces.items()}
            nbytes = 4 * sum(v.size for v in exact.values())
            if params_codec != "fp32" or senders is not None:
                payload, description = codec.encode_tensors(exact, params_codec)
                pieces = codec.decode_tensors(payload, description)
                nbytes = len(payload)
                if senders is not None:
                    keyframes[fragment] = senders[fragment].published(
                        result.version, exact, payload, description
                    )
            published[fragment] = (result.version, pieces, nbytes)
            for unit in range(s.num_units):
                # A unit hears of the version one delay later, then asks for it.
                send_global(unit, fragment, now + lines[unit].delay)
        deadline = outer.next_deadline()
        if deadline is not None:
            push(max(deadline, now), "wake", None)

    codec_states = [codec.CodecState() for _ in range(s.num_units)]

    # Per unit, the seconds its last whole-model upload held its link (``--stagger auto``).
    upload_s: list[float | None] = [None] * s.num_units

    def upload_all(unit: int, uploads: list, now: float) -> None:
        period_s = unit_h[unit] * s.step_time_s * slowdowns[unit]
        stagger_if_slow(cores[unit], uploads, algorithm.stagger, upload_s[unit], period_s)
        line = lines[unit]
        held_s = 0.0
        for up in uploads:
            # What the outer receives is what the codec lets through (as on the wire).
            shapes = {k: np.shape(v) for k, v in up.tensors.items()}
            state = codec.extend_state(wire_codec, codec_states[unit], shapes)
            payload, description, codec_states[unit] = codec.encode(up.tensors, wire_codec, state)
            received = codec.decode_tensors(payload, description)
            arrives = line.send("up", now, len(payload))
            held_s += 0.0 if line.rate is None else len(payload) / line.rate
            arrival = Arrival(
                unit,
                up.round,
                up.base_version,
                up.inner_steps,
                up.tokens,
                received,
                arrives,
                f"u{unit}r{up.round}",
            )
            push(arrives, "arrival", (up.fragment, arrival))
        if len(uploads) == fragments:
            upload_s[unit] = held_s

    stats: dict[int, int] = {}
    rejected: dict[str, int] = {}
    merged_sizes: list[int] = []
    traces: list[MergeTrace] = []
    for unit in range(s.num_units):
        push(s.step_time_s * slowdowns[unit], "step", unit)
    tokens_done = 0
    points, curve = _eval_points(s), [(0, work.eval_loss(params))]
    training = True
    while events:
        now, _, kind, payload = heapq.heappop(events)
        # Arrivals at the same instant are seen together (like one fetched batch) before the
        # outer decides whether to merge.
        same_instant = bool(events) and events[0][0] == now
        if kind == "arrival":
            fragment, arrival = payload
            # JetStream has it: with after_upload the unit wants the first version after now.
            fetch[arrival.unit].uploaded(fragment, outer.version(fragment))
            try:
                outer.offer(fragment, arrival)
            except Rejected as why:
                rejected[why.reason] = rejected.get(why.reason, 0) + 1
            if not same_instant:
                publish(now)
        elif kind == "wake" and not same_instant:
            publish(now)
        elif kind == "global":
            unit, fragment, version, pieces = payload
            cores[unit].offer_global(fragment, version, pieces)
            crossing[unit].discard(fragment)
            send_global(unit, fragment, now)  # a newer version published while this one crossed
        elif kind == "step" and training:
            unit = payload
            core = cores[unit]
            core.adopt_globals()
            core.train_step(work.samplers[unit].batch(core.step))
            tokens_done += s.tokens_per_step
            upload_all(unit, core.due_uploads(unit_h[unit]), now)
            if fetch[unit].at_step(core.step, unit_h[unit]):
                for fragment in range(fragments):
                    send_global(unit, fragment, now)
            while points and tokens_done >= points[0]:
                points.pop(0)
                curve.append(
                    (
                        tokens_done,
                        work.eval_loss(pytree.unflatten_named(params, outer.full_params())),
                    )
                )
            if tokens_done >= s.token_budget:
                training = False
                for other in range(s.num_units):
                    upload_all(other, cores[other].flush(), now)
            else:
                push(now + s.step_time_s * slowdowns[unit], "step", unit)
    # Anything a quorum policy still holds is merged at the end.
    while outer.next_deadline() is not None:
        publish(float("inf"))
    final = work.eval_loss(pytree.unflatten_named(params, outer.full_params()))
    curve.append((tokens_done, final))
    return SimResult(
        name,
        final,
        curve,
        outer.total_version,
        dict(sorted(stats.items())),
        float(np.mean(merged_sizes)) if merged_sizes else 0.0,
        traces,
        sum(line.bytes["up"] for line in lines),
        sum(line.bytes["down"] for line in lines),
        [core.staggered for core in cores],
        dict(sorted(rejected.items())),
    )
