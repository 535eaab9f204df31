"""The upload codec: named float32 tensors <-> one quantised, zstd-compressed payload.

Modules, from the public API down (docs/CODEC.md describes the format and its speed):

* :mod:`shared.codec.api`: ``encode``, ``encode_flat``, ``decode_tensors``, ``make_codec``,
  error-feedback state, ``warm_up``.
* :mod:`shared.codec.config`: what a codec configuration is (no Numba, no zstd: settings and
  the gateway import it).
* :mod:`shared.codec.description`: the typed description of a payload and its parser for
  untrusted input.
* :mod:`shared.codec.layout`: the tensors of a payload (names, shapes, flat offsets).
* :mod:`shared.codec.segments`: segment planning, per-segment encoder and decoder, threads.
* :mod:`shared.codec.quantize`, :mod:`shared.codec.dequantize`, :mod:`shared.codec.floats`:
  the compiled kernels, with their shared options in :mod:`shared.codec.jit`.
* :mod:`shared.codec.zstd`: zstd frames into and out of the payload buffer.

This file imports nothing, so that importing :mod:`shared.codec.config` stays light.
"""
