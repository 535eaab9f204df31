"""The learner unit's main loop: train, upload every H steps, adopt new global params, obey the
desired state (``idle`` and ``paused``: wait without training; ``stopped``: upload what is left
and end, as on SIGTERM).

No barrier with other units, ever: every network interaction goes through :class:`LearnerLink`,
whose methods return at once. The sync decisions themselves are ``LearnerCore``'s.

Self-healing (``--checkpoint-dir``): the unit keeps a state file (rounds used and published,
desired state, lifetime counters; ``unit_state.py``) and a checkpoint of its inner state written
at upload time on a background thread (``checkpoint.py``). A restarted unit continues from the
checkpoint's step (the data position is the step) and numbers its uploads from
``max(checkpoint round, state file's next_round, 1 + the outer's last applied round)``, so no
round number is ever used twice.

Each pass of the loop obeys the desired state, offers the core the global params the link
fetched, trains one step, hands off the uploads that are due and checkpoints (``handoff.py``)
and reports (``status_report.py``); tokens, speed and time are counted in ``accounting.py``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass

import jax

from services.learner import adversary
from services.learner.accounting import TrainingAccount
from services.learner.checkpoint import CHECKPOINT_FILE, CheckpointWriter, Restored, load_checkpoint
from services.learner.collective import (
    END,
    TRAIN,
    WAIT,
    StepPlan,
    UnitCollective,
    follow,
    initialize,
    state_checksum,
)
from services.learner.core import LearnerCore, Upload, dynamic_h
from services.learner.devices import UnitDevices, unit_devices
from services.learner.handoff import Handoff
from services.learner.link import LearnerLink
from services.learner.records import UnitIdentity
from services.learner.settings import LearnerSettings
from services.learner.stagger_rule import stagger_if_slow
from services.learner.status_report import StatusReport
from services.learner.trainer import InnerTrainer
from services.learner.unit_state import UnitState, unit_dir
from shared import data, model
from shared.runtime import configure_jax

log = logging.getLogger(__name__)

PAUSE_POLL_S = 0.1
SYNC_POLL_S = 0.01  # --mode sync: how often a waiting unit looks for the merged global
# --mode sync: a unit whose published upload is in no global after this many sync timeouts
# stops waiting for it (the outer merges a round at most one timeout after its first upload).
SYNC_GIVE_UP_FACTOR = 3
STARTUP_DESIRED_WAIT_S = 5.0


def build_core(settings: LearnerSettings) -> tuple[LearnerCore, data.BatchSampler, int]:
    """The unit's data sampler and protocol core, from the job seed (slow: JAX compiles)."""
    cfg = model.get_config(settings.model)
    corpus = data.split_corpus(
        data.load_corpus(settings.corpus, settings.corpus_max_bytes), settings.heldout_fraction
    )
    shard = data.shard_for_unit(corpus.train, settings.unit, settings.num_units)
    devices = UnitDevices(unit_devices(settings.devices), settings.shard_params)
    log.info(
        "unit %d trains on %d device(s) (%s), state %s",
        settings.unit,
        devices.count,
        ", ".join(map(str, devices.devices)),
        "sharded" if settings.shard_params and devices.count > 1 else "replicated",
    )
    # The unit's global batch: --batch-size sequences per device.
    sampler = data.BatchSampler(
        shard, cfg.seq_len, settings.batch_size * devices.count, settings.seed, settings.unit
    )
    # Every unit and the outer build the same version-0 params from the job seed, so a unit can
    # start training before it has heard from the outer (no start-up barrier either).
    params = model.init_params(cfg, jax.random.PRNGKey(settings.seed))
    trainer = InnerTrainer(cfg, settings.optimizer(settings.max_steps), devices)
    schedule = settings.sync_schedule(
        settings.fragments, adversary.own_h(settings.adversary, settings.h_steps)
    )
    core = LearnerCore(trainer, params, schedule, settings.tokens_per_step() * devices.count)
    return core, sampler, 4 * model.param_count(params)


def restore_core(settings: LearnerSettings, core: LearnerCore) -> Restored | None:
    """Restore ``core`` from the unit's checkpoint, if ``--checkpoint-dir`` has one that fits."""
    if settings.checkpoint_dir is None:
        return None
    path = unit_dir(settings.checkpoint_dir, settings.job, settings.unit) / CHECKPOINT_FILE
    # A unit of several processes places the state once all have it (share_start).
    return load_checkpoint(path, core, on_devices=settings.num_processes == 1)


def checkpoint_writer(settings: LearnerSettings, link: LearnerLink) -> CheckpointWriter | None:
    """The unit's background checkpoint writer (None without ``--checkpoint-dir``)."""
    if settings.checkpoint_dir is None:
        return None
    identity = UnitIdentity(
        job=settings.job, unit=settings.unit, model=settings.model, fragments=settings.fragments
    )
    path = unit_dir(settings.checkpoint_dir, settings.job, settings.unit) / CHECKPOINT_FILE
    return CheckpointWriter(path, identity, on_count=link.count)


@dataclass
class Unit:
    """The parts of one learner unit that its training loop drives."""

    settings: LearnerSettings
    core: LearnerCore
    sampler: data.BatchSampler
    unit_state: UnitState
    link: LearnerLink
    writer: CheckpointWriter | None
    restored: Restored | None
    # With several processes: what process 0 shares with the others (collective.py).
    collective: UnitCollective | None = None


def start_unit(settings: LearnerSettings) -> Unit:
    """Build the unit, continue from its checkpoint if it has one, start its link and checkpoint
    writer, compile the inner step, read the desired state, and number its next upload.

    Uploads are numbered from ``max(checkpoint round, state file's next_round, 1 + the outer's
    last applied round)``, so that no round number is ever used twice.
    """
    core, sampler, param_bytes = build_core(settings)
    unit_state = UnitState.for_unit(settings.checkpoint_dir, settings.job, settings.unit)
    restored = restore_core(settings, core)
    collective = None
    if settings.num_processes > 1:
        collective = UnitCollective(core)
        collective.share_start()
    link = LearnerLink(settings, 2 * param_bytes + (1 << 20), unit_state)
    if restored is not None:
        link.restore_from(restored.step, restored.residual)
    writer = checkpoint_writer(settings, link)
    if writer is not None:
        writer.start()
    link.start()
    # Compile the inner step now (the result is discarded), so that the first real step is as
    # fast as the others and a unit's reported speed and slowdown are right from the start.
    core.trainer.step(core.state, sampler.batch(0))[1].block_until_ready()
    # The codec compiles on the encoder thread meanwhile; nothing trained is thrown away
    # while it cannot encode yet (see LearnerLink.wait_codec_ready).
    waited = link.wait_codec_ready()
    if waited > 1:
        log.info("waited %.1fs for the codec kernels to compile", waited)
    # Obey the desired state from the very first step (a unit created paused stays paused);
    # if NATS cannot be reached quickly, train anyway: the loop never waits for the network.
    # The link reads the outer's record of this unit before it sets desired_known.
    link.desired_known.wait(timeout=STARTUP_DESIRED_WAIT_S)
    first_round = core.round
    core.round = max(core.round, unit_state.next_round, link.outer_next_round)
    log.info(
        "unit %d starts at step %d, round %d (checkpoint %s, state file %d, outer %d)",
        settings.unit,
        core.step,
        core.round,
        "none" if restored is None else f"round {first_round}",
        unit_state.next_round,
        link.outer_next_round,
    )
    return Unit(settings, core, sampler, unit_state, link, writer, restored, collective)


def run_learner(settings: LearnerSettings, stop: threading.Event | None = None) -> dict:
    """Train one unit until ``max_steps`` (or ``stop`` is set); returns a summary dict.

    Args:
        settings: the unit's settings.
        stop: optional event that ends training early (set by SIGTERM/SIGINT in the CLI).
    """
    configure_jax()
    if settings.num_processes > 1:
        initialize(settings.coordinator or "", settings.num_processes, settings.process_id)
        if settings.process_id > 0:
            return run_follower(settings)
    stop = stop or threading.Event()
    unit = start_unit(settings)
    core, link = unit.core, unit.link
    tokens = unit.restored.tokens_total if unit.restored is not None else 0
    account = TrainingAccount(unit.unit_state, tokens, to_host=jax.device_get)
    status = StatusReport(settings, core, account, link)
    handoff = Handoff(core, link, unit.unit_state, unit.writer, settings.checkpoint_every_s)
    stagger_h = 0

    while core.step < settings.max_steps and not stop.is_set():
        desired = link.desired_state
        if desired in ("stopped", "quarantined"):
            log.info(
                "unit %d %s by its desired state at step %d", settings.unit, desired, core.step
            )
            break
        if desired in ("paused", "idle"):
            # Idle (created, not started yet) behaves like paused: no training, no uploads.
            account.stop_running()
            if status.state != desired:
                status.state = desired
                log.info("unit %d %s at step %d", settings.unit, desired, core.step)
                status.report(force=True)
            if unit.collective is not None:
                unit.collective.share(StepPlan(WAIT))
            stop.wait(PAUSE_POLL_S)
            continue
        if status.state != "running":
            status.state = "running"
            log.info("unit %d resumed at step %d", settings.unit, core.step)
            account.restart_speed()
        account.start_running()

        offer_globals(core, link)
        next_h = unit_h(unit, account)
        if unit.collective is not None:
            plan = StepPlan(TRAIN, next_h, stagger_h, core.ready_globals())
            unit.collective.share(plan)
            stagger_h = 0
        if settings.mode != "sync":
            # Synchronous DiLoCo adopts a global only at a sync point (wait_for_merge), so that
            # a unit dropped from a round goes on from the round's global in step with the rest.
            core.adopt_globals()
        train_step(unit, account, stop)
        was_staggered = core.staggered
        uploads = due_uploads(unit, account, next_h)
        if core.staggered and not was_staggered:
            stagger_h = core.current_h  # the other processes stagger before the next step
        handoff.after_step(uploads, account.tokens)
        if uploads and settings.mode == "sync":
            account.waited_at_sync(wait_for_merge(uploads, core, link, settings, stop))
        status.report()

    if unit.collective is not None:
        unit.collective.share(StepPlan(END))  # the others take the last uploads with this one
    return finish(unit, account, status, handoff)


def run_follower(settings: LearnerSettings) -> dict:
    """A process of a unit other than process 0: the same state and steps as process 0, on its
    own devices, as process 0's plans say (``collective.py``); never on NATS."""
    core, sampler, _ = build_core(settings)
    collective = UnitCollective(core)
    collective.share_start()
    core.trainer.step(core.state, sampler.batch(0))[1].block_until_ready()
    log.info("process %d follows process 0 of unit %d", settings.process_id, settings.unit)
    adopted = follow(core, sampler, collective)
    summary = {
        "unit": settings.unit,
        "process": settings.process_id,
        "steps": core.step,
        "adopted": adopted,
        "params_checksum": state_checksum(core),
    }
    log.info("process %d of unit %d done: %s", settings.process_id, settings.unit, summary)
    return summary


def offer_globals(core: LearnerCore, link: LearnerLink) -> None:
    """Hand the global fragments the link fetched to the core; one that does not fit this
    unit (names, shapes, non-finite values) is counted in ``params_rejected`` with its reason
    and the unit trains on with what it has."""
    for fragment in link.take_new_params(core.step, core.current_h):
        try:
            core.offer_global(fragment.fragment, fragment.version, fragment.pieces, fragment.rewind)
        except ValueError as err:
            link.counters.add("params_rejected")
            link.counters.error(f"bad global params (version {fragment.version}): {err}")
            log.error("bad global params (version %d): %s", fragment.version, err)


def train_step(unit: Unit, account: TrainingAccount, stop: threading.Event) -> None:
    """One inner step on the next batch; with ``--slowdown`` s > 1, then idle (s − 1) times the
    step's time, to emulate slower hardware with the same math."""
    core = unit.core
    started = time.monotonic()
    loss = core.train_step(unit.sampler.batch(core.step))
    if unit.settings.slowdown > 1:
        # The step is dispatched asynchronously: wait for it to measure its time.
        loss.block_until_ready()
        stop.wait((unit.settings.slowdown - 1) * (time.monotonic() - started))
    account.trained(core.tokens_per_step, loss)


def unit_h(unit: Unit, account: TrainingAccount) -> int:
    """The H of the uploads due after the next step: with DyLU (``--dynamic-h``) it shrinks
    with this unit's speed relative to its peers'."""
    settings = unit.settings
    next_h = settings.h_steps
    if settings.dynamic_h:
        next_h = dynamic_h(settings.h_steps, account.tokens_per_s(), unit.link.unit_rates)
    return adversary.own_h(settings.adversary, next_h)


def due_uploads(unit: Unit, account: TrainingAccount, next_h: int) -> list[Upload]:
    """The uploads due after this step at H = ``next_h`` (``unit_h``); rounds skip ahead to
    the outer's record of this unit. When the fragments, due together, took too long to upload
    last time, they are staggered from now on (``--stagger auto``, ``stagger_rule.py``)."""
    settings, core, link = unit.settings, unit.core, unit.link
    if link.outer_next_round > core.round:
        # The outer's record arrived after the start-up wait (NATS was slow): skip ahead.
        log.warning("skipping to round %d (outer's record)", link.outer_next_round)
        core.round = link.outer_next_round
    uploads = core.due_uploads(next_h)
    if uploads:
        tokens_per_s = account.tokens_per_s()
        period_s = next_h * core.tokens_per_step / tokens_per_s if tokens_per_s else None
        upload_s = link.upload_seconds(core.plan.count)
        if stagger_if_slow(core, uploads, settings.stagger, upload_s, period_s):
            log.info(
                "staggering %d fragments: the whole model took %.1fs to upload, the period is "
                "%.1fs",
                core.plan.count,
                upload_s,
                period_s,
            )
    return uploads


def wait_for_merge(
    uploads: list[Upload],
    core: LearnerCore,
    link: LearnerLink,
    settings: LearnerSettings,
    stop: threading.Event,
) -> float:
    """Synchronous DiLoCo (``--mode sync``): block until, for every fragment just uploaded, the
    round's global has arrived (a version newer than the upload's base: merged with the upload,
    or without it when the unit was dropped from the round after the timeout), and adopt it.
    Returns the seconds waited. A dropped unit's upload is merged into the next round.

    The wait ends early on a stop or pause, or once the upload has been accepted by JetStream
    and ``SYNC_GIVE_UP_FACTOR`` sync timeouts have passed without a newer version (the outer
    rejected it): then the unit goes on from the newest version it has.
    """
    waiting = {upload.fragment: upload.base_version for upload in uploads}
    started = time.monotonic()
    published_at: float | None = None
    while waiting and not stop.is_set() and link.desired_state == "running":
        offer_globals(core, link)
        for fragment, base in list(waiting.items()):
            if core.newest_version(fragment) > base:
                del waiting[fragment]
        core.adopt_globals()
        now = time.monotonic()
        if published_at is None and link.unsent() == 0:
            published_at = now
        if published_at is not None and now - published_at > (
            SYNC_GIVE_UP_FACTOR * settings.sync_timeout_s
        ):
            log.warning(
                "no global newer than version(s) %s: going on without", sorted(waiting.values())
            )
            link.counters.add("sync_waits_abandoned")
            break
        if waiting:
            stop.wait(SYNC_POLL_S)
    return time.monotonic() - started


def finish(unit: Unit, account: TrainingAccount, status: StatusReport, handoff: Handoff) -> dict:
    """Upload what is left (partial rounds), flush the link's queue, write the final checkpoint
    and report the end; returns the run's summary."""
    settings, core, link = unit.settings, unit.core, unit.link
    account.stop_running()
    handoff.flush(account.tokens)
    status.state = "finishing"
    status.report(force=True)
    deadline = time.monotonic() + settings.flush_timeout_s
    while link.unsent() and time.monotonic() < deadline:
        time.sleep(0.05)
    handoff.close(account.tokens)
    status.state = "finished" if core.step >= settings.max_steps else "stopped"
    status.report(force=True)
    if not link.stop(flush_timeout_s=max(0.0, deadline - time.monotonic())):
        log.warning("the NATS thread did not end in time; exiting without it")
    summary = {
        "unit": settings.unit,
        "steps": core.step,
        "rounds": core.round,
        "tokens": account.tokens,
        "train_loss": account.loss_ema,
        "counters": link.counters.as_dict(),
        "restored_from_step": None if unit.restored is None else unit.restored.step,
    }
    if unit.collective is not None:  # the unit's other processes end with the same
        summary["params_checksum"] = state_checksum(core)
    log.info("unit %d done: %s", settings.unit, summary)
    return summary


def install_stop_signals(stop: threading.Event) -> None:
    """Make SIGTERM and SIGINT end training gracefully (upload what is left, then exit)."""

    def handler(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
