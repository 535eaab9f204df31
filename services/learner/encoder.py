"""Encoding a learner's uploads into wire envelopes, on one worker thread.

Uploads are encoded in queue order, each exactly once however often it is sent again: with
error feedback, encoding carries each upload's quantisation error into the next one (the
*residual*, sequential state), and a resent upload must be the same bytes for JetStream's
``Nats-Msg-Id`` deduplication to stay exact. The worker thread also compiles the codec's
kernels at start-up, off the training thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import numpy as np

from services.learner.adversary import Adversary
from services.learner.core import Upload
from services.learner.counters import Counters
from services.learner.settings import LearnerSettings
from shared.codec import api as codec
from shared.codec.config import CodecError
from shared.wire.envelope import PseudoGradEnvelope, pack_envelope

#: (round, fragment): which upload an envelope belongs to.
UploadKey = tuple[int, int]


def upload_key(upload: Upload) -> UploadKey:
    """The key of ``upload`` among the encodings."""
    return upload.round, upload.fragment


class UploadEncoder:
    """Encodes uploads on one worker thread and owns the codec's error-feedback state."""

    def __init__(self, settings: LearnerSettings, counters: Counters) -> None:
        """Args:
        settings: the unit's settings (codec, job, unit, model).
        counters: where ``fp32_bytes_encoded`` and ``payload_bytes_encoded`` are counted.
        """
        self.settings = settings
        self._counters = counters
        self._codec = settings.codec_config(settings.codec_threads)
        self._state = codec.CodecState()
        # With checkpoints and error feedback, a copy of the residual after each encoding, for
        # the training thread's snapshots (the live one is updated in place while encoding).
        self._keep_residual = settings.checkpoint_dir is not None and self._codec.error_feedback
        self._residual_copy: dict[str, np.ndarray] | None = None
        self._lock = threading.Lock()
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="encode")
        self._ready: concurrent.futures.Future[None] | None = None
        self._encodings: dict[UploadKey, asyncio.Future[bytes]] = {}
        self._adversary = Adversary(settings.adversary, settings.unit, settings.h_steps)

    def start(self) -> None:
        """Start compiling the codec's kernels on the worker thread; returns at once."""
        self._ready = self._worker.submit(codec.warm_up)

    def wait_ready(self) -> float:
        """Block until the codec's kernels are compiled (or loaded from Numba's cache); return
        the seconds waited. Call after :meth:`start`.

        Raises:
            Exception: whatever compiling the kernels raised.
        """
        assert self._ready is not None, "start() first"
        started = time.monotonic()
        self._ready.result()
        return time.monotonic() - started

    def restore_residual(self, residual: dict[str, np.ndarray] | None) -> None:
        """Continue error feedback from a checkpoint's residual (before the first encoding)."""
        if not residual or not self._codec.error_feedback:
            return
        restored = {name: np.array(value, np.float32) for name, value in residual.items()}
        self._state = codec.CodecState(residual=restored)
        if self._keep_residual:
            self._residual_copy = {name: value.copy() for name, value in restored.items()}

    def residual_copy(self) -> dict[str, np.ndarray] | None:
        """The error-feedback residual after the last finished encoding (a private copy that
        is never modified; None without checkpoints or error feedback)."""
        with self._lock:
            return self._residual_copy

    def encoding(self, upload: Upload) -> asyncio.Future[bytes]:
        """The (future) envelope of ``upload``, started on the worker thread on the first call
        and the same future on every later one. Call on the event loop.

        The future raises ``CodecError`` for an upload that must not be sent (NaN/Inf).
        """
        key = upload_key(upload)
        future = self._encodings.get(key)
        if future is None:
            loop = asyncio.get_running_loop()
            future = loop.run_in_executor(self._worker, self._encode, upload)
            # A failed encoding of an upload that is dropped before it is awaited is not an
            # unhandled error: mark its exception as retrieved.
            future.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._encodings[key] = future
        return future

    def keep_only(self, live: set[UploadKey]) -> None:
        """Forget the envelopes of every upload not in ``live`` (sent or dropped)."""
        for key in [k for k in self._encodings if k not in live]:
            del self._encodings[key]

    def shutdown(self) -> None:
        """Stop the worker thread, dropping encodings that have not started."""
        self._worker.shutdown(wait=False, cancel_futures=True)

    def _encode(self, upload: Upload) -> bytes:
        upload = self._adversary.upload(upload)
        # A fragment's residuals start at zero the first time it is sent.
        shapes = {name: np.shape(t) for name, t in upload.tensors.items()}
        state = codec.extend_state(self._codec, self._state, shapes)
        try:
            if upload.values is not None and upload.layout is not None:
                payload, description, self._state = codec.encode_flat(
                    upload.values, upload.layout, self._codec, state
                )
            else:
                payload, description, self._state = codec.encode(upload.tensors, self._codec, state)
        except CodecError:
            # The state was consumed; residuals restart from zero.
            self._state = codec.CodecState()
            raise
        if self._keep_residual:
            residual_copy = {name: value.copy() for name, value in self._state.residual.items()}
            with self._lock:
                self._residual_copy = residual_copy
        self._counters.add(
            "fp32_bytes_encoded", 4 * sum(np.size(t) for t in upload.tensors.values())
        )
        self._counters.add("payload_bytes_encoded", len(payload))
        payload, description = self._adversary.payload(upload.fragment, payload, description)
        envelope = PseudoGradEnvelope(
            job=self.settings.job,
            unit=self.settings.unit,
            round=upload.round,
            fragment=upload.fragment,
            base_version=upload.base_version,
            inner_steps=upload.inner_steps,
            tokens=upload.tokens,
            train_loss=upload.train_loss,
            codec=description,
            sent_at=time.time(),
            payload=payload,
            model=self.settings.model,
        )
        return pack_envelope(envelope)
