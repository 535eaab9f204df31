"""``diloco loadtest``: synthetic learner units (no JAX) against the real outer and broker."""
