"""A ≥10M-parameter pseudo-gradient crosses a real nats-server in chunks and reaches the outer."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from services.outer.service import OuterService
from services.outer.settings import OuterSettings
from shared import model, pytree, subjects
from shared.codec import api as codec
from shared.transport.blobs import chunk_size_for, publish_blob
from shared.transport.connection import connect
from shared.transport.streams import ensure_streams
from shared.wire.chunks import upload_id
from shared.wire.envelope import PseudoGradEnvelope, pack_envelope

pytestmark = pytest.mark.slow  # real processes and nats-server (run by make test)


@pytest.mark.timeout(300)
def test_ten_million_parameter_pseudo_gradient_round_trips_through_nats(nats_server, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(256)) * 400)
    settings = OuterSettings(
        nats_url=nats_server.url,
        job="big",
        model="medium",
        corpus=str(corpus),
        num_units=1,  # one unit: Delayed Nesterov takes a step per arrival
        fragments=1,  # the pseudo-gradient below is the whole model
        staleness_rule="constant",
        outer_momentum=0.9,
        outer_lr=0.7,
    )
    service = OuterService(settings, asyncio.Event())
    service.build_math()
    template = service.evaluator.template
    assert model.param_count(template) >= 10_000_000

    rng = np.random.default_rng(0)
    pseudo_grad = {
        name: (rng.standard_normal(array.shape) * 1e-3).astype(np.float32)
        for name, array in pytree.flatten_named(template).items()
    }
    payload, description = codec.encode_tensors(pseudo_grad, codec="int8", block_size=256)
    blob = pack_envelope(
        PseudoGradEnvelope(
            job="big",
            unit=0,
            round=0,
            fragment=0,
            base_version=0,
            inner_steps=10,
            tokens=1000,
            train_loss=3.0,
            codec=description,
            sent_at=0.0,
            payload=payload,
            model="medium",
        )
    )

    async def scenario():
        nc = await connect(settings, "test")
        js = nc.jetstream()
        await ensure_streams(js)
        max_payload = nc.max_payload
        chunk_size = chunk_size_for(nc)
        sequences = await publish_blob(
            js, subjects.grads_subject("big", 0, 0), blob, upload_id("big", 0, 0, 0), chunk_size
        )
        sent = len(sequences)
        assert sent == -(-len(blob) // chunk_size) and sent >= 10
        # Retrying the same upload is deduplicated by Nats-Msg-Id: the stream holds one copy,
        # and the retry is told where each chunk already is.
        again = await publish_blob(
            js, subjects.grads_subject("big", 0, 0), blob, upload_id("big", 0, 0, 0), chunk_size
        )
        assert again == sequences
        info = await js.stream_info(subjects.GRADS_STREAM)
        assert info.state.messages == sent

        sub = await service.subscribe(js)
        before = service.core.full_params()
        sizes = []
        while service.ledger.applied == 0:
            msgs = await sub.fetch(8, timeout=5)
            sizes += [
                len(m.data) + sum(len(k) + len(v) for k, v in m.headers.items()) for m in msgs
            ]
            assert await service.intake.take(msgs) == 0
            await service.merge_due(now=float("inf"))
        await nc.close()
        return before, max_payload, sizes

    before, max_payload, sizes = asyncio.run(scenario())
    assert max(sizes) < max_payload, "no message may exceed the server's max_payload"
    assert service.core.total_version == 1 and service.ledger.rejected == {}

    # First Nesterov step from zero momentum: θ1 = θ0 − lr·(1 + β)·Δ, so Δ is recoverable.
    after = service.core.full_params()
    received = {name: (before[name] - after[name]) / (0.7 * 1.9) for name in before}
    for name, sent_tensor in pseudo_grad.items():
        # int8 blockwise: each element is off by at most half a quantization step.
        step = np.abs(sent_tensor).max() / 127
        np.testing.assert_allclose(received[name], sent_tensor, atol=step * 0.5 + 2e-6, rtol=0)
    total = np.concatenate([v.ravel() for v in pseudo_grad.values()])
    error = np.concatenate([(received[k] - v).ravel() for k, v in pseudo_grad.items()])
    assert np.linalg.norm(error) / np.linalg.norm(total) < 0.01
