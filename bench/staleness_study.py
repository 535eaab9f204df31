"""One simulated run of the staleness study (docs/ALGORITHMS.md, "Staleness"): the shipped
algorithm and codecs on ``sim/training.py`` with every unit behind the same shaped link, but for
the settings named on the command line. Appends its result (commit, configuration, final eval,
staleness histogram, bytes each way, largest momentum norm) to
``bench/results/staleness_study.jsonl``.

    .venv/bin/python bench/staleness_study.py NAME UNITS LINK|none STEPS [SETTING=VALUE ...]

e.g. ``... 1mL1 2 1mbit/50ms 300 momentum_max_age=1``; SETTING is any algorithm or codec
setting, or ``seed``. Model ``small``, inner step 0.256 s of simulated time, 50 ms latency.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import jax  # noqa: E402
from quality import configure_jax  # noqa: E402  (bench/ is on sys.path as a script)
from report import commit  # noqa: E402

from shared import data, evaluation, model  # noqa: E402
from shared.link_spec import parse_link  # noqa: E402
from shared.settings.algorithm import AlgorithmSettings  # noqa: E402
from shared.settings.codec import CodecSettings  # noqa: E402
from shared.settings.workload import WorkloadSettings  # noqa: E402
from sim import training as sim  # noqa: E402

RESULTS = REPO / "bench" / "results" / "staleness_study.jsonl"
STEP_TIME_S = 0.256  # a `small` unit's inner step on the real 2-unit 1 Mbit/s run


def main() -> None:
    name, units, link, steps, *pairs = sys.argv[1:]
    algorithm, codec, seed = {}, {}, 0
    for pair in pairs:
        key, value = pair.split("=", 1)
        if key == "seed":
            seed = int(value)
        elif key in CodecSettings.model_fields:
            codec[key] = value
        else:
            algorithm[key] = value
    configure_jax()
    workload = WorkloadSettings(model="small", max_steps=int(steps), seed=seed)
    setup = sim.SimSetup(
        workload=workload,
        algorithm=AlgorithmSettings(**algorithm),
        codec=CodecSettings(**codec),
        num_units=int(units),
        step_time_s=STEP_TIME_S,
        latency_s=0.05,
        link=None if link == "none" else parse_link(link),
        evals=4,
    )
    cfg = model.get_config("small")
    corpus = data.split_corpus(data.load_corpus(None), 0.02)
    evaluate = evaluation.make_evaluator(cfg, data.eval_batches(corpus.heldout, cfg.seq_len, 16, 8))
    init = model.init_params(cfg, jax.random.PRNGKey(seed))
    started = time.time()
    result = sim.async_run(sim.Workload(setup, corpus, evaluate), init, [1.0] * int(units))
    row = {
        "name": name,
        "commit": commit(RESULTS),
        "units": int(units),
        "link": link,
        "steps": int(steps),
        "settings": pairs,
        "algorithm": setup.algorithm.model_dump(mode="json"),
        "codec": setup.codec.model_dump(mode="json"),
        "final": result.final_eval,
        "curve": result.curve,
        "staleness": result.staleness,
        "versions": result.outer_steps,
        "up": result.bytes_up,
        "down": result.bytes_down,
        "mom_max": max((m.momentum_norm for m in result.merges), default=0.0),
        "secs": time.time() - started,
    }
    print(json.dumps(row))
    with RESULTS.open("a") as out:
        out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
