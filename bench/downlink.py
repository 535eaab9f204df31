"""Params downlink: bytes per fetch and reconstruction error, global copy vs delta.

Real global params of the ``small`` model: pseudo-gradients of a short training run (as
``bench/codec.py`` captures them; ``--rounds`` of H steps), each merged by the outer's core
(``OuterCore``, shipped algorithm, one unit) into a new version. For every version after the
first, a unit fetches it (or, with ``--every N``, every N-th version: one cumulative delta):

* ``copy <codec>``: the global copy's envelope in ``--params-codec`` (what ``copy`` sends);
* ``delta <codec>``: the delta envelope ``shared.downlink.DownlinkSender`` sends a unit that
  holds what it was sent before (the first fetch is a keyframe, not counted here).

Reports the mean envelope bytes per fetch, their ratio to the int8 copy, and the relative L2
error of what the unit holds against the exact global params (mean over the fetches, and at
the last one). Raw numbers go to ``bench/results/downlink.json`` (``downlink_every<N>.json``).

    .venv/bin/python bench/downlink.py [--every 4]    # ≈ 2 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from codec import capture_rounds, log  # noqa: E402  (bench/ is on sys.path as a script)

from services.outer.core import OuterCore  # noqa: E402
from services.outer.downlink import delta_envelope  # noqa: E402
from services.outer.policy import Arrival  # noqa: E402
from services.outer.publishing import params_envelope  # noqa: E402
from shared.codec import api as codec  # noqa: E402
from shared.downlink import Delta, DownlinkSender, Held, Keyframe  # noqa: E402
from shared.settings.algorithm import AlgorithmSettings  # noqa: E402

RESULTS = REPO / "bench" / "results"
MODEL = "small"


def versions(rounds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The global params after each merge (version 0 first)."""
    import jax

    from shared import model, pytree

    named = pytree.flatten_named(model.init_params(model.get_config(MODEL), jax.random.PRNGKey(0)))
    core = OuterCore(named, AlgorithmSettings().outer_algorithm(1))
    out = [{k: np.array(v, np.float32) for k, v in core.fragment_params(0).items()}]
    for number, pseudo_grad in enumerate(rounds):
        arrival = Arrival(
            0, number, core.version(0), 30, 30 * 2048, pseudo_grad, time.monotonic(), f"r{number}"
        )
        core.offer(0, arrival)
        core.merge(0)
        out.append({k: np.array(v, np.float32) for k, v in core.fragment_params(0).items()})
    return out


def rel_error(held: dict[str, np.ndarray], exact: dict[str, np.ndarray]) -> float:
    num = sum(float(np.sum((held[k].astype(np.float64) - exact[k]) ** 2)) for k in exact)
    den = sum(float(np.sum(exact[k].astype(np.float64) ** 2)) for k in exact)
    return (num / den) ** 0.5


def copy_row(params: list[dict[str, np.ndarray]], fetched: list[int], params_codec: str) -> dict:
    sizes, errors = [], []
    for v in fetched:
        blob, _ = params_envelope("bench", MODEL, 0, v, 0, params[v], params_codec)
        payload, description = codec.encode_tensors(params[v], params_codec, zstd_level=1)
        sizes.append(len(blob))
        errors.append(rel_error(codec.decode_tensors(payload, description), params[v]))
    return {"method": f"copy {params_codec}", "bytes": sizes, "errors": errors}


def delta_row(
    params: list[dict[str, np.ndarray]], fetched: list[int], delta_codec: str, params_codec: str
) -> dict:
    sender = DownlinkSender(delta_codec)
    held: Held | None = None
    sizes, errors, keyframes = [], [], 0
    for v in [0, *fetched]:
        payload, description = codec.encode_tensors(params[v], params_codec, zstd_level=1)
        sender.published(v, params[v], payload, description)
        answer = sender.answer(
            0, -1 if held is None else held.version, held.checksum if held else 0
        )
        if isinstance(answer, Keyframe):
            held = Held.of(v, codec.decode_tensors(payload, description))
            if v:
                keyframes += 1
                sizes.append(
                    len(params_envelope("bench", MODEL, 0, v, 0, params[v], params_codec)[0])
                )
        else:
            assert isinstance(answer, Delta)
            held = sender.records(0)[-1]
            sizes.append(len(delta_envelope("bench", MODEL, 0, answer)))
        if v:
            errors.append(rel_error(held.pieces, params[v]))
    return {
        "method": f"delta {delta_codec}",
        "bytes": sizes,
        "errors": errors,
        "keyframes": keyframes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12, help="merges (versions after 0)")
    parser.add_argument("--every", type=int, default=1, help="fetch every N-th version")
    parser.add_argument("--params-codec", default="int8", help="the copies' (keyframes') codec")
    args = parser.parse_args()
    log(f"capturing {args.rounds} rounds of real pseudo-gradients of {MODEL}...")
    params = versions(capture_rounds(args.rounds))
    fetched = list(range(args.every, len(params), args.every))
    rows = [copy_row(params, fetched, args.params_codec)] + [
        delta_row(params, fetched, c, args.params_codec) for c in ("int8", "int4", "int2")
    ]
    reference = float(np.mean(rows[0]["bytes"]))
    elements = sum(v.size for v in params[0].values())
    print(
        f"{MODEL}: {elements} params ({4 * elements} fp32 bytes); {len(fetched)} fetches "
        f"(every {args.every} version(s)); keyframes in {args.params_codec}\n"
    )
    print("| method | bytes per fetch | vs copy | rel. L2 error, mean | at the last |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        mean = float(np.mean(row["bytes"]))
        row["mean_bytes"] = mean
        print(
            f"| {row['method']} | {mean:,.0f} | {mean / reference:.2f} | "
            f"{np.mean(row['errors']):.2e} | {row['errors'][-1]:.2e} |"
        )
    suffix = "" if args.every == 1 else f"_every{args.every}"
    (RESULTS / f"downlink{suffix}.json").write_text(
        json.dumps(
            {
                "command": " ".join(["bench/downlink.py", *sys.argv[1:]]),
                "model": MODEL,
                "params": elements,
                "every": args.every,
                "params_codec": args.params_codec,
                "rows": rows,
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
