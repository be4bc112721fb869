"""One rank of a distributed test run (tests/test_distributed.py starts N of these).

    python tests/distributed_driver.py BUNDLE SPLIT CASES.json [--drafter PATH] [--forever]

Every rank reports its resident weights as one JSON line {"rank", "weights", "active"};
rank 0 then runs each case (engine.generate(**case)) and prints {"results": [tokens per case],
"calls": [{"round_trips": forward calls through the shards, "passes": verifier passes}]}.
--forever: rank 0 keeps generating (prints "generating" first) until it is stopped.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import mlx.core as mx

import edgespec.distributed as dist


def main() -> int:
    bundle, split, cases_path = sys.argv[1:4]
    drafter = sys.argv[sys.argv.index("--drafter") + 1] if "--drafter" in sys.argv else "none"
    forever = "--forever" in sys.argv

    def loaded(rank, model, plan):
        # What stays resident: collect cyclic garbage (a transient the loading left in a
        # reference cycle still counts as active) and finish pending work before measuring.
        gc.collect()
        mx.synchronize()
        mx.clear_cache()
        line = {"rank": rank, "weights": dist.shard_bytes(model, plan), "active": mx.get_active_memory()}
        print(json.dumps(line), flush=True)

    engine = dist.load(bundle, split=split, drafter=drafter, history="off", on_loaded=loaded)
    if engine is None:
        return 0
    cases = json.loads(open(cases_path).read())
    if forever:
        print("generating", flush=True)
        while True:
            for case in cases:
                engine.generate(**case)
    results, calls = [], []
    for case in cases:
        before = engine.model.calls
        if "prompts" in case:  # one batch: engine.generate_many
            case = dict(case)
            rs = engine.generate_many(case.pop("prompts"), **case)
            results.append([r.tokens for r in rs])
            calls.append({"round_trips": engine.model.calls - before, "passes": None})
            continue
        r = engine.generate(**case)
        results.append(r.tokens)
        calls.append({"round_trips": engine.model.calls - before, "passes": r.stats.verifier_passes})
    print(json.dumps({"results": results, "calls": calls}), flush=True)
    engine.model.close()  # the followers leave their loop and exit 0
    # Skip interpreter teardown: the engine's batching thread (a daemon) aborts it at exit
    # ("terminate called without an active exception"), single-process too.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
