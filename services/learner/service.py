"""The learner unit's main loop: train, upload every H steps, adopt new global params, obey pause.

No barrier with other units, ever: every network interaction goes through :class:`LearnerLink`,
whose methods return at once.
"""

from __future__ import annotations

import logging
import signal
import threading
import time

import jax
import numpy as np

from services.learner.link import LearnerLink, PendingUpload
from services.learner.settings import LearnerSettings
from services.learner.trainer import InnerTrainer, inner_optimizer
from shared import data, model, pytree
from shared.runtime import configure_jax

log = logging.getLogger(__name__)

PAUSE_POLL_S = 0.1


def run_learner(settings: LearnerSettings, stop: threading.Event | None = None) -> dict:
    """Train one unit until ``max_steps`` (or ``stop`` is set); returns a summary dict.

    Args:
        settings: the unit's settings.
        stop: optional event that ends training early (set by SIGTERM/SIGINT in the CLI).
    """
    configure_jax()
    stop = stop or threading.Event()
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
    init_params = model.init_params(cfg, jax.random.PRNGKey(settings.seed))
    param_bytes = 4 * model.param_count(init_params)
    trainer = InnerTrainer(
        cfg,
        inner_optimizer(
            settings.inner_lr, settings.warmup_steps, settings.max_steps, settings.weight_decay
        ),
    )
    state = trainer.init(init_params)
    base_version = 0

    link = LearnerLink(settings, max_params_bytes=2 * param_bytes + (1 << 20))
    link.start()

    step = 0
    round_index = 0
    steps_since_upload = 0
    tokens_since_upload = 0
    tokens_total = 0
    loss_sum = 0.0
    loss_ema = float("nan")
    rate_window: list[tuple[float, int]] = [(time.monotonic(), 0)]
    tokens_per_step = settings.batch_size * cfg.seq_len
    last_status = 0.0
    state_name = "running"

    def report(force: bool = False) -> None:
        nonlocal last_status
        now = time.monotonic()
        if not force and now - last_status < settings.status_interval_s / 2:
            return
        last_status = now
        (t0, s0) = rate_window[0]
        rate = (tokens_total - s0) / (now - t0) if now > t0 else 0.0
        rate_window.append((now, tokens_total))
        del rate_window[:-10]
        link.set_status(
            state=state_name,
            step=step,
            max_steps=settings.max_steps,
            round=round_index,
            base_version=base_version,
            train_loss=None if np.isnan(loss_ema) else round(loss_ema, 4),
            tokens=tokens_total,
            tokens_per_s=round(rate, 1),
        )

    while step < settings.max_steps and not stop.is_set():
        if link.desired_state == "paused":
            if state_name != "paused":
                state_name = "paused"
                log.info("unit %d paused at step %d", settings.unit, step)
                report(force=True)
            stop.wait(PAUSE_POLL_S)
            continue
        if state_name != "running":
            state_name = "running"
            log.info("unit %d resumed at step %d", settings.unit, step)
            rate_window[:] = [(time.monotonic(), tokens_total)]

        newest = link.take_new_params(newer_than=base_version)
        if newest is not None:
            global_params = pytree.unflatten_named(init_params, newest.tensors)
            state = trainer.rebase(state, global_params)
            base_version = newest.version

        state, loss = trainer.step(state, sampler.batch(step))
        step += 1
        steps_since_upload += 1
        tokens_since_upload += tokens_per_step
        tokens_total += tokens_per_step
        loss_value = float(loss)
        loss_sum += loss_value
        loss_ema = loss_value if np.isnan(loss_ema) else 0.9 * loss_ema + 0.1 * loss_value

        if steps_since_upload >= settings.h_steps or step == settings.max_steps:
            state, pseudo_grad = trainer.take_pseudo_gradient(state)
            link.submit(
                PendingUpload(
                    round=round_index,
                    base_version=base_version,
                    inner_steps=steps_since_upload,
                    tokens=tokens_since_upload,
                    train_loss=loss_sum / steps_since_upload,
                    tensors=pytree.flatten_named(pseudo_grad),
                )
            )
            round_index += 1
            steps_since_upload = tokens_since_upload = 0
            loss_sum = 0.0
        report()

    # Send whatever is left (a partial round after an early stop), then flush the queue.
    if steps_since_upload:
        state, pseudo_grad = trainer.take_pseudo_gradient(state)
        link.submit(
            PendingUpload(
                round_index,
                base_version,
                steps_since_upload,
                tokens_since_upload,
                loss_sum / steps_since_upload,
                pytree.flatten_named(pseudo_grad),
            )
        )
        round_index += 1
    state_name = "finishing"
    report(force=True)
    deadline = time.monotonic() + settings.flush_timeout_s
    while link.unsent() and time.monotonic() < deadline:
        time.sleep(0.05)
    state_name = "finished" if step >= settings.max_steps else "stopped"
    report(force=True)
    link.stop(flush_timeout_s=max(0.0, deadline - time.monotonic()))
    summary = {
        "unit": settings.unit,
        "steps": step,
        "rounds": round_index,
        "tokens": tokens_total,
        "train_loss": loss_ema,
        "counters": dict(link.counters),
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
