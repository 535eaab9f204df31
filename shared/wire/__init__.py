"""The wire between learners and the outer: envelopes, and the chunks they travel in.

* :mod:`shared.wire.envelope`: the typed, versioned msgpack envelope of a pseudo-gradient
  upload or of a version of global params (hostile input checked field by field).
* :mod:`shared.wire.chunks`: upload ids, chunk headers, cutting a blob into NATS-sized chunks
  and reassembling it (the outer's checkpoints travel in the same chunks).
"""
