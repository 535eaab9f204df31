"""A discrete-event model of whole clusters on a simulated clock: compute time per step, links
with bandwidth and latency, failures with repair times, and each method's blocking behaviour.
No JAX: it counts tokens and seconds, not losses (``docs/SCALING.md``).

* ``model.py``: the inputs (units, links, method, failures) and the outcome;
* ``engine.py``: the simulation;
* ``scenarios.py``: the calibrated small cluster of ``bench/goodput.py``, the chip-scale sweep
  and the 12B / four regions time budget.
"""
