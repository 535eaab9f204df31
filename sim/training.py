"""Run a whole job in one process on a simulated clock: the quality benchmark's engine.

The same ``LearnerCore`` and ``OuterCore`` that the services run are driven here by an event
queue instead of NATS and wall-clock time, so unit speeds are exact and runs are repeatable and
quick. Unit u's inner step takes ``step_time_s × slowdown_u`` simulated seconds; an upload
reaches the outer, and a published global fragment reaches the units, ``latency_s`` later.
Baselines that share the model, data, inner optimizer and token budget live here too:
data-parallel training and synchronous DiLoCo (arXiv 2311.08105, Algorithm 1).

Every method starts from the same parameters (e.g. a briefly pretrained checkpoint), and every
unit u trains on its own shard with ``BatchSampler(seed, unit=u)``, exactly as a learner does.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from services.learner.core import LearnerCore, SyncSchedule, dynamic_h
from services.learner.trainer import InnerTrainer, inner_optimizer
from services.outer.core import OuterAlgorithm, OuterCore
from services.outer.optimizer import make_outer_optimizer, make_outer_step
from services.outer.policy import Arrival
from shared import data, model, pytree
from shared.codec import api as codec
from shared.codec.config import CodecConfig
from shared.evaluation import EvalResult


@dataclass(frozen=True)
class SimSetup:
    """Everything a simulated run shares with the other methods it is compared with."""

    model: str = "small"
    num_units: int = 4
    batch_size: int = 16
    steps_per_unit: int = 120  # the token budget is num_units × steps_per_unit × batch × seq
    h_steps: int = 20
    inner_lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    seed: int = 0
    step_time_s: float = 0.5
    latency_s: float = 0.25
    evals: int = 8  # evaluations along the run (plus one at the start and one at the end)

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * model.get_config(self.model).seq_len

    @property
    def token_budget(self) -> int:
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


class Workload:
    """Model, data and evaluator shared by every method of one benchmark run."""

    def __init__(
        self, setup: SimSetup, corpus: data.CorpusSplit, evaluate: Callable[[Any], EvalResult]
    ) -> None:
        self.setup = setup
        self.cfg = model.get_config(setup.model)
        self.evaluate = evaluate
        self.shards = [
            data.shard_for_unit(corpus.train, unit, setup.num_units)
            for unit in range(setup.num_units)
        ]
        self.samplers = [
            data.BatchSampler(shard, self.cfg.seq_len, setup.batch_size, setup.seed, unit)
            for unit, shard in enumerate(self.shards)
        ]
        self._trainers: dict[int, InnerTrainer] = {}

    def with_seed(self, seed: int) -> Workload:
        """The same workload with another data order (jitted trainers are shared)."""
        other = Workload.__new__(Workload)
        other.__dict__.update(self.__dict__)
        other.setup = dataclasses.replace(self.setup, seed=seed)
        other.samplers = [
            data.BatchSampler(shard, self.cfg.seq_len, self.setup.batch_size, seed, unit)
            for unit, shard in enumerate(self.shards)
        ]
        return other

    def trainer(self, horizon: int) -> InnerTrainer:
        """An inner trainer whose cosine schedule spans ``horizon`` steps (cached: jit)."""
        if horizon not in self._trainers:
            s = self.setup
            self._trainers[horizon] = InnerTrainer(
                self.cfg, inner_optimizer(s.inner_lr, s.warmup_steps, horizon, s.weight_decay)
            )
        return self._trainers[horizon]

    def eval_loss(self, params: Any) -> float:
        return float(self.evaluate(params).nats_per_byte)


def pretrain(work: Workload, params: Any, steps: int) -> Any:
    """Single-unit inner steps on unit 0's shard: the shared starting checkpoint."""
    trainer = work.trainer(max(steps, 1))
    state = trainer.init(params)
    sampler = data.BatchSampler(
        work.shards[0], work.cfg.seq_len, work.setup.batch_size, work.setup.seed + 10_000, 0
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


def sync_diloco(work: Workload, params: Any, lr: float = 0.7, momentum: float = 0.9) -> SimResult:
    """DiLoCo Algorithm 1: every unit takes H steps from the same global, barrier, average,
    outer Nesterov. Unit speeds do not change the math (only the wall-clock)."""
    s = work.setup
    trainer = work.trainer(s.steps_per_unit)
    optimizer = make_outer_optimizer("nesterov", lr, momentum)
    outer_step = make_outer_step(optimizer)
    global_params, opt_state = params, optimizer.init(params)
    states = [trainer.init(params) for _ in range(s.num_units)]
    points, curve = _eval_points(s), [(0, work.eval_loss(params))]
    step, outer_steps = 0, 0
    while step < s.steps_per_unit:
        h = min(s.h_steps, s.steps_per_unit - step)
        deltas = []
        for unit, state in enumerate(states):
            state = state._replace(params=global_params)
            for k in range(h):
                state, _ = trainer.step(state, work.samplers[unit].batch(step + k))
            states[unit] = state
            deltas.append(jax.tree_util.tree_map(lambda g, p: g - p, global_params, state.params))
        mean = jax.tree_util.tree_map(lambda *d: sum(d) / len(d), *deltas)
        global_params, opt_state = outer_step(global_params, opt_state, mean)
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
    algorithm: OuterAlgorithm,
    slowdowns: list[float],
    schedule: SyncSchedule,
    dynamic: bool = False,
    name: str = "async",
    codec_config: CodecConfig | None = None,
    params_codec: str = "fp32",
    params_fetch: str = "newest",
) -> SimResult:
    """Decoupled DiLoCo on a simulated clock: units never wait; the outer merges by policy.

    Units step until the job has processed the token budget (fast units take more of it); then
    every unit uploads what it has left and the outer merges everything still buffered.
    Uploads go through ``codec_config`` (default: int8) as on the wire, each unit with its own
    error-feedback state. Globals reach a unit as the learner fetches them
    (``params_fetch``: ``newest``, every version, as no link is slow here; ``after_upload``,
    the first version of a fragment published after each of the unit's uploads of it), in
    ``params_codec``.
    """
    wire_codec = codec_config or CodecConfig()
    s = work.setup
    speeds = [1.0 / f for f in slowdowns]
    share = [v / sum(speeds) for v in speeds]
    total_steps = s.num_units * s.steps_per_unit
    named = pytree.flatten_named(params)
    outer = OuterCore(named, algorithm)
    rates = {u: speeds[u] for u in range(s.num_units)}
    # With DyLU each unit's H follows its speed from the first round on (speeds are known here).
    unit_h = [
        dynamic_h(schedule.h_steps, rates[u], rates) if dynamic else schedule.h_steps
        for u in range(s.num_units)
    ]
    cores = [
        LearnerCore(
            work.trainer(max(1, round(total_steps * share[u]))),
            params,
            dataclasses.replace(schedule, h_steps=unit_h[u]),
            s.tokens_per_step,
        )
        for u in range(s.num_units)
    ]
    counter = itertools.count()
    events: list[tuple[float, int, str, Any]] = []
    # Per unit and fragment: deliver the first version newer than this (None: none wanted),
    # as services/learner/params_fetcher.py fetches.
    wanted: list[list[int | None]] = [[-1] * schedule.fragments for _ in range(s.num_units)]

    def push(time: float, kind: str, payload: Any) -> None:
        heapq.heappush(events, (time, next(counter), kind, payload))

    def publish(now: float) -> None:
        for fragment in outer.due(now):
            result = outer.merge(fragment)
            for staleness in result.staleness:
                stats[staleness] = stats.get(staleness, 0) + 1
            merged_sizes.append(len(result.arrivals))
            pieces = outer.fragment_params(fragment)
            if params_codec != "fp32":
                exact = {k: np.asarray(v) for k, v in pieces.items()}
                payload, description = codec.encode_tensors(exact, params_codec)
                pieces = codec.decode_tensors(payload, description)
            for unit in range(s.num_units):
                want = wanted[unit][fragment]
                newest = params_fetch == "newest"
                if newest or (want is not None and result.version > want):
                    wanted[unit][fragment] = None
                    push(now + s.latency_s, "global", (unit, fragment, result.version, pieces))
        deadline = outer.next_deadline()
        if deadline is not None:
            push(max(deadline, now), "wake", None)

    codec_states = [codec.CodecState() for _ in range(s.num_units)]

    def upload_all(unit: int, uploads: list, now: float) -> None:
        for up in uploads:
            # What the outer receives is what the codec lets through (as on the wire).
            shapes = {k: np.shape(v) for k, v in up.tensors.items()}
            state = codec.extend_state(wire_codec, codec_states[unit], shapes)
            payload, description, codec_states[unit] = codec.encode(up.tensors, wire_codec, state)
            received = codec.decode_tensors(payload, description)
            wanted[unit][up.fragment] = outer.version(up.fragment)
            arrival = Arrival(
                unit,
                up.round,
                up.base_version,
                up.inner_steps,
                up.tokens,
                received,
                now + s.latency_s,
                f"u{unit}r{up.round}",
            )
            push(now + s.latency_s, "arrival", (up.fragment, arrival))

    stats: dict[int, int] = {}
    merged_sizes: list[int] = []
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
            outer.offer(fragment, arrival)
            if not same_instant:
                publish(now)
        elif kind == "wake" and not same_instant:
            publish(now)
        elif kind == "global":
            unit, fragment, version, pieces = payload
            cores[unit].offer_global(fragment, version, pieces)
        elif kind == "step" and training:
            unit = payload
            core = cores[unit]
            core.adopt_globals()
            core.train_step(work.samplers[unit].batch(core.step))
            tokens_done += s.tokens_per_step
            upload_all(unit, core.due_uploads(unit_h[unit]), now)
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
    )
