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
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time

import jax

from services.learner.checkpoint import (
    CHECKPOINT_FILE,
    CheckpointWriter,
    Restored,
    load_checkpoint,
    take_snapshot,
)
from services.learner.core import LearnerCore, Upload, dynamic_h
from services.learner.link import LearnerLink
from services.learner.records import UnitIdentity
from services.learner.settings import LearnerSettings
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
# How often the status report writes the unit's lifetime counters (time up and computing,
# tokens computed) to its state file: each write is fsynced; a killed unit loses at most this
# much of its counted up time.
LIFETIME_WRITE_S = 2.0
STARTUP_DESIRED_WAIT_S = 5.0


def build_core(settings: LearnerSettings) -> tuple[LearnerCore, data.BatchSampler, int]:
    """The unit's data sampler and protocol core, from the job seed (slow: JAX compiles)."""
    cfg = model.get_config(settings.model)
    corpus = data.split_corpus(
        data.load_corpus(settings.corpus, settings.corpus_max_bytes), settings.heldout_fraction
    )
    shard = data.shard_for_unit(corpus.train, settings.unit, settings.num_units)
    sampler = data.BatchSampler(
        shard, cfg.seq_len, settings.batch_size, settings.seed, settings.unit
    )
    # Every unit and the outer build the same version-0 params from the job seed, so a unit can
    # start training before it has heard from the outer (no start-up barrier either).
    params = model.init_params(cfg, jax.random.PRNGKey(settings.seed))
    trainer = InnerTrainer(cfg, settings.optimizer(settings.max_steps))
    schedule = settings.sync_schedule(settings.fragments)
    core = LearnerCore(trainer, params, schedule, settings.tokens_per_step())
    return core, sampler, 4 * model.param_count(params)


def offer_globals(core: LearnerCore, link: LearnerLink) -> None:
    """Hand the global fragments the link fetched to the core; one that does not fit this
    unit (names, shapes, non-finite values) is counted in ``params_rejected`` with its reason
    and the unit trains on with what it has."""
    for fragment in link.take_new_params():
        try:
            core.offer_global(fragment.fragment, fragment.version, fragment.pieces, fragment.rewind)
        except ValueError as err:
            link.counters.add("params_rejected")
            link.counters.error(f"bad global params (version {fragment.version}): {err}")
            log.error("bad global params (version %d): %s", fragment.version, err)


def restore_core(settings: LearnerSettings, core: LearnerCore) -> Restored | None:
    """Restore ``core`` from the unit's checkpoint, if ``--checkpoint-dir`` has one that fits."""
    if settings.checkpoint_dir is None:
        return None
    path = unit_dir(settings.checkpoint_dir, settings.job, settings.unit) / CHECKPOINT_FILE
    return load_checkpoint(path, core)


def checkpoint_writer(settings: LearnerSettings, link: LearnerLink) -> CheckpointWriter | None:
    """The unit's background checkpoint writer (None without ``--checkpoint-dir``)."""
    if settings.checkpoint_dir is None:
        return None
    identity = UnitIdentity(
        job=settings.job, unit=settings.unit, model=settings.model, fragments=settings.fragments
    )
    path = unit_dir(settings.checkpoint_dir, settings.job, settings.unit) / CHECKPOINT_FILE
    return CheckpointWriter(path, identity, on_count=link.count)


def hand_off(
    uploads: list[Upload],
    core: LearnerCore,
    link: LearnerLink,
    unit_state: UnitState,
    writer: CheckpointWriter | None,
    tokens_total: int,
) -> None:
    """Hand uploads just taken from ``core`` to the link, durably numbered.

    First the state file records that every round below ``core.round`` is used (so a restarted
    unit can never reuse one, even if it crashes right after a publish), then a snapshot goes to
    the checkpoint writer (taken now, the anchor matches these uploads), then the uploads are
    queued.
    """
    if not uploads:
        return
    unit_state.reserve(core.round)
    if writer is not None:
        writer.submit(take_snapshot(core, tokens_total, link.residual_copy()))
    for upload in uploads:
        link.submit(upload)


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


def run_learner(settings: LearnerSettings, stop: threading.Event | None = None) -> dict:
    """Train one unit until ``max_steps`` (or ``stop`` is set); returns a summary dict.

    Args:
        settings: the unit's settings.
        stop: optional event that ends training early (set by SIGTERM/SIGINT in the CLI).
    """
    configure_jax()
    stop = stop or threading.Event()
    core, sampler, param_bytes = build_core(settings)
    unit_state = UnitState.for_unit(settings.checkpoint_dir, settings.job, settings.unit)
    restored = restore_core(settings, core)
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

    tokens_total = restored.tokens_total if restored is not None else 0
    tokens_at_start = tokens_total  # this process trained tokens_total - tokens_at_start
    # What earlier processes of the unit did: seconds training, of which computing, and tokens.
    before = (unit_state.trained_s, unit_state.computing_s, unit_state.computed_tokens)
    loss_ema = float("nan")
    # The steps' losses, on the device until a status report reads them (in step order).
    unread_losses: list[jax.Array] = []
    rate_window: list[tuple[float, int]] = [(time.monotonic(), tokens_total)]
    # Seconds spent training (running) in this process, and when the running stretch began.
    training_s = 0.0
    sync_wait_s = 0.0  # --mode sync: time spent waiting at sync points
    running_since: float | None = None
    last_status = 0.0
    last_snapshot = time.monotonic()  # when the newest checkpoint was taken
    last_lifetime_write = 0.0  # when the lifetime counters were last written to the state file
    state_name = "running"

    def rate() -> float:
        (t0, tokens0) = rate_window[0]
        now = time.monotonic()
        return (tokens_total - tokens0) / (now - t0) if now > t0 else 0.0

    def read_losses() -> None:
        nonlocal loss_ema
        for loss in jax.device_get(unread_losses):
            value = float(loss)
            loss_ema = value if math.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * value
        unread_losses.clear()

    def report(force: bool = False) -> None:
        nonlocal last_status, last_lifetime_write
        now = time.monotonic()
        if not force and now - last_status < settings.status_interval_s / 2:
            return
        last_status = now
        read_losses()
        # Reading the losses waits for every step dispatched so far: only now do the tokens
        # counted and the time elapsed describe the same work.
        now = time.monotonic()
        tokens_per_s = rate()
        rate_window.append((now, tokens_total))
        del rate_window[:-10]
        trained_s = training_s + (now - running_since if running_since is not None else 0.0)
        # The unit's healthy speed over its whole life, not this process's: on shared cores a
        # unit computes faster while others are down, and a fresh process has little to go by.
        life_trained = before[0] + trained_s
        life_computing = before[1] + max(0.0, trained_s - sync_wait_s)
        life_tokens = before[2] + tokens_total - tokens_at_start
        healthy = life_tokens / life_computing if life_computing > 0 else 0.0
        versions = core.base_versions()
        first = unit_state.first_trained_at
        if trained_s > 0 and (force or now - last_lifetime_write >= LIFETIME_WRITE_S):
            unit_state.set_lifetime(life_trained, life_computing, life_tokens)
            last_lifetime_write = now
        link.set_status(
            state=state_name,
            step=core.step,
            max_steps=settings.max_steps,
            round=core.round,
            base_version=sum(versions),
            base_versions=versions,
            train_loss=round(loss_ema, 4) if math.isfinite(loss_ema) else None,
            tokens=tokens_total,
            tokens_per_s=round(tokens_per_s, 1),
            training_s=round(trained_s, 3),
            compute_tokens_per_s=round(healthy, 1),
            slowdown=settings.slowdown,
            model=settings.model,
            num_units=settings.num_units,
            tokens_per_step=core.tokens_per_step,
            sync_wait_s=round(sync_wait_s, 3),
            lifetime_s=None if first is None else round(max(0.0, time.time() - first), 3),
            lifetime_training_s=round(life_trained, 3),
        )

    while core.step < settings.max_steps and not stop.is_set():
        desired = link.desired_state
        if desired == "stopped":
            log.info("unit %d stopped by its desired state at step %d", settings.unit, core.step)
            break
        if desired in ("paused", "idle"):
            # Idle (created, not started yet) behaves like paused: no training, no uploads.
            if running_since is not None:
                training_s += time.monotonic() - running_since
                running_since = None
            if state_name != desired:
                state_name = desired
                log.info("unit %d %s at step %d", settings.unit, desired, core.step)
                report(force=True)
            stop.wait(PAUSE_POLL_S)
            continue
        if state_name != "running":
            state_name = "running"
            log.info("unit %d resumed at step %d", settings.unit, core.step)
            rate_window[:] = [(time.monotonic(), tokens_total)]
        if running_since is None:
            running_since = time.monotonic()
            unit_state.mark_trained(time.time())

        offer_globals(core, link)
        if settings.mode != "sync":
            # Synchronous DiLoCo adopts a global only at a sync point (wait_for_merge), so that
            # a unit dropped from a round goes on from the round's global in step with the rest.
            core.adopt_globals()

        started = time.monotonic()
        loss = core.train_step(sampler.batch(core.step))
        if settings.slowdown > 1:
            # Emulate slower hardware: same math, (slowdown - 1)x the step's time idle (the
            # step is dispatched asynchronously: wait for it to measure its time).
            loss.block_until_ready()
            stop.wait((settings.slowdown - 1) * (time.monotonic() - started))
        unread_losses.append(loss)
        tokens_total += core.tokens_per_step

        next_h = settings.h_steps
        if settings.dynamic_h:
            next_h = dynamic_h(settings.h_steps, rate(), link.unit_rates)
        if link.outer_next_round > core.round:
            # The outer's record arrived after the start-up wait (NATS was slow): skip ahead.
            log.warning("skipping to round %d (outer's record)", link.outer_next_round)
            core.round = link.outer_next_round
        uploads = core.due_uploads(next_h)
        hand_off(uploads, core, link, unit_state, writer, tokens_total)
        now = time.monotonic()
        if uploads:
            last_snapshot = now
        elif writer is not None and 0 < settings.checkpoint_every_s <= now - last_snapshot:
            writer.submit(take_snapshot(core, tokens_total, link.residual_copy()))
            last_snapshot = now
        if uploads and settings.mode == "sync":
            sync_wait_s += wait_for_merge(uploads, core, link, settings, stop)
        report()

    if running_since is not None:
        training_s += time.monotonic() - running_since
        running_since = None
    # Send whatever is left (partial rounds), then flush the queue.
    hand_off(core.flush(), core, link, unit_state, writer, tokens_total)
    state_name = "finishing"
    report(force=True)
    deadline = time.monotonic() + settings.flush_timeout_s
    while link.unsent() and time.monotonic() < deadline:
        time.sleep(0.05)
    if writer is not None:
        # After the flush, so that the residual includes every upload that went out.
        writer.close(final=take_snapshot(core, tokens_total, link.residual_copy()))
    state_name = "finished" if core.step >= settings.max_steps else "stopped"
    report(force=True)
    link.stop(flush_timeout_s=max(0.0, deadline - time.monotonic()))
    summary = {
        "unit": settings.unit,
        "steps": core.step,
        "rounds": core.round,
        "tokens": tokens_total,
        "train_loss": loss_ema,
        "counters": link.counters.as_dict(),
        "restored_from_step": None if restored is None else restored.step,
    }
    log.info("unit %d done: %s", settings.unit, summary)
    return summary


def install_stop_signals(stop: threading.Event) -> None:
    """Make SIGTERM and SIGINT end training gracefully (upload what is left, then exit)."""

    def handler(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
