"""The verifier sharded over local processes (MLX ring backend on 127.0.0.1), drafter on rank 0.

Each group run starts N copies of tests/distributed_driver.py; rank 0 runs every case and
its tokens must equal the single-process engine's: greedy for plain, speculative,
adaptive, tree and lookahead, and seeded sampling for plain, speculative and adaptive.
A batch of sequences (engine.generate_many) shares passes through the shards.
Each rank also reports the weights it holds (about 1/N of the model).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import write_tiny_bundle

import edgespec
from edgespec.distributed import EXIT_PEER_LOST, DistributedError
from edgespec.distributed.launch import spawn_local
from edgespec.distributed.shard import load_shard, pipeline_ranges, shard_bytes, tensor_config

DRIVER = str(Path(__file__).with_name("distributed_driver.py"))
# heads, KV heads and MLP width divisible by 2 and 3 (tensor split); 6 layers split evenly
ARCH = dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=6, intermediate_size=192, num_hidden_layers=6)
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [12, 30, 41, 12, 30]]
# speculative with a fixed K: with K "auto" the controller times the passes, so which K
# (and so which random draws) a round uses changes from run to run when sampling
SPEC = dict(mode="speculative", draft_tokens=3)
# pipeline=True: the drafter drafts round n+1 in a worker thread during round n's pass
GREEDY = [dict(mode="plain"), SPEC, dict(SPEC, pipeline=True), dict(mode="adaptive"), dict(mode="tree"),
          dict(mode="lookahead")]
SAMPLED = [dict(c, temperature=0.8, seed=7) for c in (dict(mode="plain"), SPEC, dict(mode="adaptive"))]
CASES = [dict(prompt=p, max_tokens=20, **c) for p in PROMPTS for c in GREEDY + SAMPLED]
# continuous batching: several sequences in one verifier pass (per-row caches, masks, positions)
CASES.append(dict(prompts=PROMPTS + [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]], max_tokens=12, mode="plain"))
ROUND_TRIPS = [dict(prompt=PROMPTS[1], max_tokens=20, mode="plain"), dict(prompt=PROMPTS[1], max_tokens=20, **SPEC)]


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    verifier = write_tiny_bundle(root / "verifier", seed=3, scale=4.0, **ARCH)
    # the drafter: the same weights' first layer only, so drafts are often accepted
    drafter = write_tiny_bundle(root / "drafter", seed=3, scale=4.0, **dict(ARCH, num_hidden_layers=1))
    cases = root / "cases.json"
    cases.write_text(json.dumps(CASES))
    trips = root / "trips.json"
    trips.write_text(json.dumps(ROUND_TRIPS))
    return verifier, drafter, cases, trips


@pytest.fixture(scope="module")
def reference(bundles):
    verifier, drafter, _, _ = bundles
    engine = edgespec.load(verifier, drafter=str(drafter), history="off", progress=False)
    out = []
    for c in CASES:
        if "prompts" in c:
            c = dict(c)
            out.append([r.tokens for r in engine.generate_many(c.pop("prompts"), **c)])
        else:
            out.append(engine.generate(**c).tokens)
    return out


def model_bytes(bundle: Path) -> int:
    return sum(v.nbytes for v in mx.load(str(bundle / "model.safetensors")).values())


def run_group(n: int, split: str, bundles, cases: Path, *extra: str, drafter=None, timeout: float = 180):
    verifier = bundles[0]
    drafter = drafter or bundles[1]
    procs = spawn_local(n, [sys.executable, DRIVER, str(verifier), split, str(cases), "--drafter", str(drafter), *extra],
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (code, _, err) in enumerate(outs):
        assert code == 0, f"rank {rank} exited with {code}:\n{err[-3000:]}"
    lines = [[json.loads(line) for line in out.splitlines() if line.startswith("{")] for _, out, _ in outs]
    memory = {line["rank"]: line for rank_lines in lines for line in rank_lines if "rank" in line}
    result = next(line for line in lines[0] if "results" in line)
    return result, memory


@pytest.mark.parametrize("split,n", [("pipeline", 2), ("tensor", 2), ("pipeline", 3), ("tensor", 3)])
def test_sharded_verifier_equals_single_process(bundles, reference, split, n):
    result, memory = run_group(n, split, bundles, bundles[2])
    wrong = [(case, want, got) for case, want, got in zip(CASES, reference, result["results"], strict=True) if got != want]
    assert not wrong, f"{split} x{n}: {len(wrong)} cases differ: {wrong}"
    # every rank holds about 1/N of the weights, and that is what is resident
    total = model_bytes(bundles[0])
    assert sorted(memory) == list(range(n))
    for rank, m in memory.items():
        assert 0.6 * total / n <= m["weights"] <= 1.4 * total / n, (rank, m, total)
        # Resident = its shard: a rank holding another's weights would be 50-100% over. The
        # slack covers a few small runtime arrays (once 43 KB over a 677 KB shard in CI).
        assert m["active"] <= m["weights"] * 1.05 + 65536, (rank, m)
    assert sum(m["weights"] for m in memory.values()) >= total


def test_speculation_cuts_round_trips(bundles):
    """Round trips through the shards per generated token: plain makes one per token;
    speculative one per verify pass (the local drafter's K drafts cost none), so its round
    trips per token fall by at least its tokens-per-pass factor."""
    # the verifier as its own drafter: every greedy draft is accepted
    result, _ = run_group(2, "pipeline", bundles, bundles[3], drafter=bundles[0])
    (plain, spec), (pc, sc) = result["results"], result["calls"]
    assert plain == spec
    # one round trip for the prompt (one prefill chunk), then one per verifier pass: the
    # drafter's K drafts never touch the shards; with the exactness guard on (the suite's
    # default), one more when the request ends: its replay from empty caches (one chunk)
    from edgespec.logits.exactness import guard_enabled

    replay = 1 if guard_enabled() else 0
    assert pc["round_trips"] == 1 + pc["passes"] + replay and sc["round_trips"] == 1 + sc["passes"] + replay, \
        (pc, sc)
    plain_rt, spec_rt = pc["passes"] / len(plain), sc["passes"] / len(spec)  # decode round trips per token
    tokens_per_pass = len(spec) / sc["passes"]
    assert tokens_per_pass > 1.5
    assert plain_rt / spec_rt >= tokens_per_pass, (pc, sc, len(spec))


def test_killed_rank_ends_the_group(bundles):
    verifier, drafter, cases, _ = bundles
    procs = spawn_local(3, [sys.executable, DRIVER, str(verifier), "pipeline", str(cases), "--drafter", str(drafter),
                            "--forever"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in procs[0].stdout:
            if line.startswith("generating"):
                break
        time.sleep(0.5)
        procs[1].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        codes = [procs[r].wait(timeout=20) for r in (0, 2)]
        waited = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [EXIT_PEER_LOST, EXIT_PEER_LOST]
    for r in (0, 2):
        err = procs[r].stderr.read()
        assert f"edgespec distributed: rank {r} " in err and "ending the group" in err, err[-2000:]
    print(f"survivors ended {waited:.2f} s after the kill")


# ---- in-process checks of the sharding plans -----------------------------------------

def test_pipeline_ranges_balance_bytes():
    # rank 0 carries the embedding/head (here 2 layers' worth): it gets fewer layers
    assert pipeline_ranges([10] * 8, 20, 2) == [(0, 3), (3, 8)]  # 20+30 | 50
    assert pipeline_ranges([10] * 6, 0, 3) == [(0, 2), (2, 4), (4, 6)]
    assert pipeline_ranges([10] * 6, 30, 3) == [(0, 0), (0, 3), (3, 6)]  # the head alone is 1/3
    with pytest.raises(DistributedError, match="too few"):
        pipeline_ranges([10], 0, 3)


def test_tensor_split_needs_divisible_heads():
    cfg = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=64)
    assert tensor_config(cfg, 2)["num_key_value_heads"] == 1
    with pytest.raises(DistributedError, match="divisible by 3.*pipeline"):
        tensor_config(cfg, 3)


@pytest.mark.parametrize("split", ["pipeline", "tensor"])
def test_each_shard_loads_only_its_weights(bundles, split):
    total = model_bytes(bundles[0])
    sizes = []
    for rank in range(2):
        model, plan, _ = load_shard(bundles[0], split, rank, 2)
        sizes.append(shard_bytes(model, plan))
        del model
    assert all(0.6 * total / 2 <= s <= 1.4 * total / 2 for s in sizes), (sizes, total)


# ---- the CLI: --distributed starts the ranks through mlx.launch ----------------------

def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "edgespec.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("app", ["generate", "chat"])
def test_cli_distributed_equals_single_process(bundles, app):
    common = [app, "--model", str(bundles[0]), "--drafter", str(bundles[1]), "--prompt", "abc",
              "--max-tokens", "12", "--mode", "speculative", "--draft-tokens", "3"]
    common += ["--stats", "none"] if app == "generate" else ["--no-stats"]
    alone = _cli(*common)
    assert alone.stdout.strip(), alone.stderr[-2000:]
    shared = _cli(*common, "--distributed", "local:2", "--distributed-split", "tensor")
    assert shared.returncode == 0, shared.stderr[-3000:]
    assert shared.stdout == alone.stdout


def test_cli_distributed_bad_hostfile(bundles, tmp_path):
    bad = tmp_path / "hosts.json"
    bad.write_text('{"hosts": [{"ssh": "a"}]}')
    for spec, message in [(str(tmp_path / "missing.json"), "no such hostfile"), (str(bad), "expected"),
                          ("local:0", "local:N with N in 1..64")]:
        r = _cli("generate", "--model", str(bundles[0]), "--prompt", "x", "--distributed", spec)
        assert r.returncode == 1 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- the newer architectures -----------------------------------------------------------

MOE_CASES = [dict(prompt=PROMPTS[0] * 3, max_tokens=16, mode=m) for m in ("plain", "prompt_lookup", "lookahead")]
MOE_CASES.append(dict(prompt=PROMPTS[1], max_tokens=16, mode="plain", temperature=0.8, seed=7))


def _converted(tmp_path, arch: str) -> Path:
    from edgespec.converters.convert import convert
    from test_arch_moe_gemma4 import checkpoint

    checkpoint(tmp_path / arch, arch, seed=1)
    convert(tmp_path / arch, tmp_path / f"{arch}-bundle", quantize="none", dtype="float32", progress=False)
    return tmp_path / f"{arch}-bundle"


def test_qwen3_moe_pipeline_equals_single_process(tmp_path):
    """Qwen3-MoE (sparse and dense layers, every layer windowed) split over 2 ranks by layers:
    greedy (plain, prompt lookup, lookahead) and seeded sampled output equal one process's."""
    pytest.importorskip("transformers")
    bundle = _converted(tmp_path, "qwen3_moe")
    engine = edgespec.load(bundle, drafter="none", history="off", progress=False)
    want = [engine.generate(**c).tokens for c in MOE_CASES]
    cases = tmp_path / "moe_cases.json"
    cases.write_text(json.dumps(MOE_CASES))
    result, memory = run_group(2, "pipeline", (bundle, "none"), cases)
    assert result["results"] == want
    assert sorted(memory) == [0, 1] and all(m["weights"] < model_bytes(bundle) for m in memory.values())


def test_moe_tensor_split_and_gemma4_are_refused_by_name(tmp_path):
    pytest.importorskip("transformers")
    moe = _converted(tmp_path, "qwen3_moe")
    with pytest.raises(DistributedError, match="mixture-of-experts.*'qwen3_moe'.*pipeline"):
        load_shard(moe, "tensor", 0, 2)
    gemma = _converted(tmp_path, "gemma4_text")
    for split in ("pipeline", "tensor"):
        with pytest.raises(DistributedError, match="'gemma4_text'.*per-layer inputs.*shared keys"):
            load_shard(gemma, split, 0, 2)
