"""Prefix reuse, saved caches and KV quantization (issue #36), side by side in one run.

    LD_PRELOAD=$(make -s preload) .venv/bin/python benchmarks/prefix_reuse.py [--json out.json]
        [--model BUNDLE] [--turns 8] [--turn-chars 1300] [--max-tokens 32] [--drafter DRAFTER]
        [--skip server,drafter,chat,concurrency,kv] [--kv-context 4096] [--kv-gen 128] [--kv-prompts 3]
        [--concurrency-turns 4] [--concurrency-cache-bytes 120M] [--compare-drafter-reuse] [--no-mlx-lm]
        [--mode MODE]

a. A growing conversation (--turns turns, each adding a user message of about
   --turn-chars characters, a few hundred tokens; replies of --max-tokens appended)
   through three servers started together: `edgespec serve` (prefix reuse on, the
   default), `edgespec serve --prompt-cache-bytes 0` (off) and mlx-lm's server (its prompt
   cache on by default) on the same weights. Each turn is sent to the three in turn (the
   order rotating), streamed; time to first token = until the first content chunk.
   --compare-drafter-reuse adds a fourth, prefix reuse on but the drafter's own cache
   prefilled from scratch each turn (EDGESPEC_DRAFTER_REUSE=off); --no-mlx-lm drops mlx-lm's.
a2. In-process, the drafter's own prefill at each turn of that conversation (what mode
   speculative runs before its first token): from scratch against restoring the earlier
   turn's blocks from the drafter's store (--drafter-repeats alternating runs each).
b. The same conversation through `edgespec chat` (a subprocess, stdin piped, one line a
   turn): the stats line's reused prompt tokens per turn.
c. 4 conversations interleaved through one server with a small --prompt-cache-bytes (each
   round's 4 requests sent together): cached_tokens per turn, /health's prompt_cache
   after each round, and the server's peak RSS (VmHWM).
d. KV quantization, in-process: KV bytes of a --kv-context-token context at full
   precision, 8 and 4 bits (caches filled, each layer's .nbytes summed); greedy agreement of
   --kv-gen tokens with the full-precision cache over --kv-prompts prompts; mean
   log-likelihood difference per token of a fixed text (teacher-forced); decode tokens/s
   relative to full precision (alternating runs).

The default model is SmolLM2-135M-Instruct (the bundle under $EDGESPEC_HOME, which
defaults here to the repository's .cache/edgespec as in the tests).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("EDGESPEC_HOME", str(REPO / ".cache" / "edgespec"))
sys.path.insert(0, str(REPO / "tests"))

# --------------------------------------------------------------------------- the conversation
TOPICS = [
    "the water cycle", "how a bicycle gear works", "the history of the printing press",
    "why the sky is blue", "how bread rises", "the rules of chess openings",
    "how vaccines train the immune system", "the life of honey bees", "how a refrigerator cools",
    "plate tectonics", "how compilers optimise loops", "the migration of arctic terns",
]


def _corpus() -> list[str]:
    """Paragraphs written for this project (benchmarks/prompts/mixed.jsonl), in file order."""
    out = []
    for line in (REPO / "benchmarks" / "prompts" / "mixed.jsonl").read_text(encoding="utf-8").splitlines():
        obj = json.loads(line)
        texts = [obj["prompt"]] if "prompt" in obj else [m["content"] for m in obj["messages"]]
        out.extend(" ".join(t.split()) for t in texts if len(t) > 80)
    return out


def user_turns(n: int, chars: int, offset: int = 0) -> list[str]:
    """n single-line user messages of about `chars` characters each (different text each)."""
    corpus, turns, i = _corpus(), [], offset * 7
    for k in range(n):
        topic = TOPICS[(k + offset) % len(TOPICS)]
        parts = [f"Here are my notes, part {k + 1}, while I read about {topic}."]
        while sum(map(len, parts)) < chars:
            parts.append(corpus[i % len(corpus)])
            i += 1
        parts.append(f"In one sentence: what links these notes to {topic}?")
        turns.append(" ".join(parts))
    return turns


# --------------------------------------------------------------------------- servers
class MlxLmServer:
    """`python -m mlx_lm.server --model BUNDLE --port P` (its prompt cache on by default)."""

    def __init__(self, bundle: str, timeout: float = 180.0):
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"mlx-lm-server-{os.getpid()}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_lm.server", "--model", bundle, "--port",
                                      str(self.port), "--max-tokens", "512"], stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx-lm's server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"mlx-lm's server did not start; see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def stream_turn(url: str, messages: list[dict], max_tokens: int, edgespec: bool, mode: str | None = None) -> dict:
    """One streamed chat request: time to the first content chunk, the reply, usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if edgespec:
        body["model"] = "default"
        if mode:
            body["mode"] = mode
    t0 = time.perf_counter()
    ttft, text, usage, stats = None, [], None, {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            for c in obj.get("choices") or []:
                piece = (c.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(piece)
            if obj.get("usage"):
                usage = obj["usage"]
            if obj.get("edgespec"):  # edgespec's decoding stats, on its last event
                stats = obj["edgespec"]
    total = time.perf_counter() - t0
    cached = ((usage or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return {"ttft_s": ttft if ttft is not None else total, "total_s": total, "reply": "".join(text),
            "prompt_tokens": (usage or {}).get("prompt_tokens"), "cached_tokens": cached,
            "prefill_s": stats.get("prefill_s"), "drafter_cached_tokens": stats.get("drafter_cached_tokens")}


def peak_rss(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        import psutil

        return psutil.Process(pid).memory_info().rss
    except Exception:
        return None


def serve_args(args) -> list[str]:
    return ["--history", "off", *(["--drafter", args.drafter] if args.drafter else [])]


def _drafter_reuse_off_server(bundle: str, args):
    """An edgespec server with prefix reuse on but the drafter's own cache not reused
    (EDGESPEC_DRAFTER_REUSE=off in its environment): the state before the drafter's store."""
    from server_support import ServerProcess

    old = os.environ.get("EDGESPEC_DRAFTER_REUSE")
    os.environ["EDGESPEC_DRAFTER_REUSE"] = "off"
    try:
        return ServerProcess(Path(bundle), *serve_args(args))
    finally:
        if old is None:
            del os.environ["EDGESPEC_DRAFTER_REUSE"]
        else:
            os.environ["EDGESPEC_DRAFTER_REUSE"] = old


def bench_server(args, bundle: str) -> dict:
    from server_support import ServerProcess

    turns = user_turns(args.turns, args.turn_chars)
    names = ["edgespec", "edgespec_no_reuse"]
    if args.compare_drafter_reuse:
        names.insert(1, "edgespec_no_drafter_reuse")
    if not args.no_mlx_lm:
        names.append("mlx_lm")
    servers = {}
    try:
        servers["edgespec"] = ServerProcess(Path(bundle), *serve_args(args))
        if args.compare_drafter_reuse:
            servers["edgespec_no_drafter_reuse"] = _drafter_reuse_off_server(bundle, args)
        servers["edgespec_no_reuse"] = ServerProcess(Path(bundle), *serve_args(args), "--prompt-cache-bytes", "0")
        if not args.no_mlx_lm:
            servers["mlx_lm"] = MlxLmServer(bundle)
        # warm-up: one short request each, a conversation of its own (its blocks stay cached
        # on the reuse servers, but share no prefix with the measured one beyond the template)
        for name in names:
            stream_turn(servers[name].url, [{"role": "user", "content": "Say hi."}], 4, name != "mlx_lm")
        convs = {n: [] for n in names}
        rows = {n: [] for n in names}
        for k, text in enumerate(turns):
            order = names[k % len(names):] + names[: k % len(names)]
            for name in order:
                convs[name].append({"role": "user", "content": text})
                res = stream_turn(servers[name].url, convs[name], args.max_tokens, name != "mlx_lm", args.mode)
                convs[name].append({"role": "assistant", "content": res["reply"]})
                rows[name].append(res)
            print(f"  turn {k + 1}: " + ", ".join(f"{n} {rows[n][-1]['ttft_s'] * 1000:.0f} ms "
                                                 f"({rows[n][-1]['cached_tokens']}/{rows[n][-1]['prompt_tokens']} cached)"
                                                 for n in names), file=sys.stderr)
        health = httpx.get(servers["edgespec"].url + "/health").json()
    finally:
        for s in servers.values():
            s.stop()
    out = {"turns": args.turns, "turn_chars": args.turn_chars, "max_tokens": args.max_tokens, "per_turn": [],
           "servers": names, "mode": args.mode or "auto"}
    for k in range(args.turns):
        row = {
            "turn": k + 1,
            "prompt_tokens": rows["edgespec"][k]["prompt_tokens"],
            **{f"{n}_ttft_ms": rows[n][k]["ttft_s"] * 1000 for n in names},
            "edgespec_cached_tokens": rows["edgespec"][k]["cached_tokens"],
            "no_reuse_cached_tokens": rows["edgespec_no_reuse"][k]["cached_tokens"],
        }
        if "mlx_lm" in names:
            row["mlx_lm_cached_tokens"] = rows["mlx_lm"][k]["cached_tokens"]
            row["edgespec_vs_mlx_lm"] = rows["edgespec"][k]["ttft_s"] / rows["mlx_lm"][k]["ttft_s"]
        if "edgespec_no_drafter_reuse" in names:
            row["edgespec_vs_no_drafter_reuse"] = (rows["edgespec"][k]["ttft_s"]
                                                   / rows["edgespec_no_drafter_reuse"][k]["ttft_s"])
        for n in names:  # the server's own prefill time (drafter's begin included) and drafter reuse
            if n != "mlx_lm":
                row[f"{n}_prefill_ms"] = (rows[n][k]["prefill_s"] or 0.0) * 1000
                row[f"{n}_drafter_cached_tokens"] = rows[n][k]["drafter_cached_tokens"]
        out["per_turn"].append(row)
    for n in names:
        out[f"{n}_last_over_first"] = rows[n][-1]["ttft_s"] / rows[n][0]["ttft_s"]
    out["same_replies"] = {n: [r["reply"] for r in rows[n]] == [r["reply"] for r in rows["edgespec"]] for n in names}
    out["prompt_cache_after"] = health.get("prompt_cache")
    return out


# --------------------------------------------------------------------------- drafter
def bench_drafter(args, bundle: str) -> dict:
    """In-process, the drafter's own prefill at each turn of the conversation (what mode
    speculative does before its first token): from scratch against restoring the earlier
    turn's blocks from the drafter's store, alternating, --drafter-repeats times each."""
    import mlx.core as mx

    import edgespec
    from edgespec.drafters.base import DrafterReuse

    engine = edgespec.load(bundle, progress=False, history="off",
                           **({"drafter": args.drafter} if args.drafter else {}))
    store = engine.drafter_prefix_cache
    if store is None:
        return {"skipped": f"drafter {getattr(engine.drafter, 'name', None)!r} has no cache of its own to reuse"}
    msgs, prompts = [], []
    for text in user_turns(args.turns, args.turn_chars):
        msgs.append({"role": "user", "content": text})
        prompts.append(engine.encode_prompt(messages=msgs))
        msgs.append({"role": "assistant", "content": "Noted; the link is the topic itself, seen from each part."})

    def begin(tokens, reuse: bool) -> tuple[float, int]:
        d = engine.drafter.fork()
        if reuse:
            d.prefix_reuse = DrafterReuse(store, d)
        t = time.perf_counter()
        d.begin(tokens)
        mx.synchronize()
        return time.perf_counter() - t, d.prefilled

    rows = []
    for k, tokens in enumerate(prompts):
        fresh, reused, ran = [], [], None
        for _ in range(args.drafter_repeats):
            engine.prefix_cache.clear()
            if k:  # what the earlier turn left: its prompt and reply, up to the last whole block
                begin(prompts[k - 1] + tokens[len(prompts[k - 1]):len(prompts[k - 1]) + 16], True)
            reused.append(begin(tokens, True))
            fresh.append(begin(tokens, False))
        ran = reused[-1][1]
        rows.append({"turn": k + 1, "prompt_tokens": len(tokens), "drafter_prefilled_with_reuse": ran,
                     "fresh_ms": [t * 1000 for t, _ in fresh], "reuse_ms": [t * 1000 for t, _ in reused]})
        print(f"  turn {k + 1}: {len(tokens)} tokens; drafter prefill from scratch "
              f"{statistics.median(rows[-1]['fresh_ms']):.0f} ms, with reuse "
              f"{statistics.median(rows[-1]['reuse_ms']):.0f} ms ({ran} positions run)", file=sys.stderr)
    return {"drafter": engine.drafter.name, "repeats": args.drafter_repeats, "per_turn": rows}


# --------------------------------------------------------------------------- chat
def bench_chat(args, bundle: str) -> dict:
    turns = user_turns(args.turns, args.turn_chars)
    cmd = [sys.executable, "-m", "edgespec.cli", "chat", "--model", bundle, "--max-tokens", str(args.max_tokens),
           *serve_args(args)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, input="\n".join(turns) + "\n", capture_output=True, text=True, timeout=1800)
    secs = time.perf_counter() - t0
    if p.returncode:
        raise RuntimeError(f"edgespec chat exited {p.returncode}: {p.stderr[-2000:]}")
    stats = re.findall(r"^\[([\d.]+) tok/s, (\d+) tokens(?:, (\d+) of (\d+) prompt tokens reused)?\]$",
                       p.stderr, re.M)
    per_turn = [{"turn": i + 1, "tok_s": float(s[0]), "tokens": int(s[1]),
                 "reused": int(s[2]) if s[2] else 0, "prompt_tokens": int(s[3]) if s[3] else None}
                for i, s in enumerate(stats)]
    return {"command": " ".join(["edgespec", *cmd[3:]]), "per_turn": per_turn, "wall_s": secs,
            "stats_lines": len(stats)}


# --------------------------------------------------------------------------- concurrency
def bench_concurrency(args, bundle: str) -> dict:
    from server_support import ServerProcess

    n_conv = 4
    convs = [[] for _ in range(n_conv)]
    texts = [user_turns(args.concurrency_turns, args.turn_chars, offset=3 * c + 1) for c in range(n_conv)]
    srv = ServerProcess(Path(bundle), *serve_args(args), "--prompt-cache-bytes", args.concurrency_cache_bytes)
    rounds, cached = [], [[] for _ in range(n_conv)]
    samples: list[int] = []
    stop = threading.Event()

    def sampler():
        while not stop.is_set():
            v = peak_rss(srv.proc.pid)
            if v:
                samples.append(v)
            stop.wait(0.2)

    watch = threading.Thread(target=sampler, daemon=True)
    watch.start()
    try:
        base_rss = peak_rss(srv.proc.pid)
        for k in range(args.concurrency_turns):
            results: list = [None] * n_conv

            def one(c, k=k, results=results):
                convs[c].append({"role": "user", "content": texts[c][k]})
                results[c] = stream_turn(srv.url, convs[c], args.max_tokens, True)

            threads = [threading.Thread(target=one, args=(c,)) for c in range(n_conv)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for c in range(n_conv):
                if results[c] is None:
                    raise RuntimeError("a concurrent request failed")
                convs[c].append({"role": "assistant", "content": results[c]["reply"]})
                cached[c].append((results[c]["cached_tokens"], results[c]["prompt_tokens"]))
            pc = httpx.get(srv.url + "/health").json()["prompt_cache"]
            rounds.append(pc)
            print(f"  round {k + 1}: cached " + ", ".join(f"{a}/{b}" for a, b in (cached[c][-1] for c in range(n_conv)))
                  + f"; cache {pc['bytes'] / 2**20:.1f} of {pc['max_bytes'] / 2**20:.1f} MiB, "
                  f"{pc['evicted_blocks']} blocks evicted", file=sys.stderr)
        hwm = peak_rss(srv.proc.pid)
    finally:
        stop.set()
        srv.stop()
    return {"conversations": n_conv, "turns": args.concurrency_turns, "prompt_cache_bytes": args.concurrency_cache_bytes,
            "cached_tokens": [[{"cached": a, "prompt": b} for a, b in conv] for conv in cached],
            "health_after_round": rounds, "within_budget": all(r["bytes"] + r.get("drafter_bytes", 0) <= r["max_bytes"] for r in rounds),
            "rss_after_load_bytes": base_rss, "peak_rss_bytes": hwm}


# --------------------------------------------------------------------------- KV quantization
FIXED_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, "
    "polished the great lens until it shone, and wrote the weather in a leather logbook: wind from "
    "the south-west, a swell building, two fishing boats returning late. In winter the storms came in "
    "from the open sea and the whole tower hummed with the wind. He did not mind. He had a kettle, a "
    "shelf of books about ships and stars, and a cat who slept on the warm floor beneath the lamp room. "
    "When the supply boat came each fortnight he traded letters with his sister, who lived in the city "
    "and could not understand why anyone would choose such a quiet life. "
)


def _fill(engine, caches, ids, chunk=512):
    import mlx.core as mx

    for s in range(0, len(ids), chunk):
        # the logits depend on every layer's cache write: evaluating them fills the caches
        mx.eval(engine.model(mx.array(ids[s:s + chunk], dtype=mx.int32)[None], caches, last_only=True))


def _loglik(engine, ids, chunk=256) -> list[float]:
    """Log-probability of each actual next token, teacher-forced in chunks over `engine`'s caches."""
    import mlx.core as mx

    caches, out = engine.make_cache(), []
    for s in range(0, len(ids) - 1, chunk):
        piece = ids[s:min(s + chunk, len(ids) - 1)]
        logits = engine.model(mx.array(piece, dtype=mx.int32)[None], caches)[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        nxt = mx.array(ids[s + 1:s + 1 + len(piece)], dtype=mx.int32)
        out.extend(mx.take_along_axis(lp, nxt[:, None], axis=-1)[:, 0].tolist())
    return out


def _set_kv(engine, bits):
    engine.kv_bits = bits
    engine.prefix_cache.clear()  # no reuse across settings in this measurement


def bench_kv(args, bundle: str) -> dict:
    import edgespec

    engine = edgespec.load(bundle, drafter="none", progress=False, prompt_cache_bytes=0)
    kinds = [None, 8, 4]
    label = {None: "full", 8: "8-bit", 4: "4-bit"}
    text_ids = engine.encode_prompt(FIXED_TEXT * 40)
    ctx_ids = (text_ids * (args.kv_context // len(text_ids) + 1))[:args.kv_context]
    mem = {}
    for bits in kinds:
        _set_kv(engine, bits)
        caches = engine.make_cache()
        _fill(engine, caches, ctx_ids)
        mem[label[bits]] = sum(c.nbytes for c in caches)
        del caches
    # quality: greedy agreement and teacher-forced log-likelihood
    prompts = [p.split(".")[0] + "." for p in _corpus()[: args.kv_prompts * 3: 3]][: args.kv_prompts]
    gen = {}
    for bits in kinds:
        _set_kv(engine, bits)
        gen[label[bits]] = [engine.generate(messages=[{"role": "user", "content": p}], max_tokens=args.kv_gen,
                                            mode="plain").tokens for p in prompts]
    agree = {}
    for bits in kinds[1:]:
        same = total = 0
        first_diff = []
        for ref, got in zip(gen["full"], gen[label[bits]], strict=True):
            n = min(len(ref), len(got))
            d = next((i for i in range(n) if ref[i] != got[i]), n)
            first_diff.append(d)
            same += sum(a == b for a, b in zip(ref, got, strict=False))
            total += max(len(ref), len(got))
        agree[label[bits]] = {"positionwise": same / total, "first_divergence": first_diff}
    ll_ids = text_ids[: args.kv_ll_tokens]
    ll = {}
    for bits in kinds:
        _set_kv(engine, bits)
        ll[label[bits]] = _loglik(engine, ll_ids)
    ll_diff = {label[b]: statistics.fmean(q - f for q, f in zip(ll[label[b]], ll["full"], strict=True)) for b in kinds[1:]}
    ll_abs = {label[b]: statistics.fmean(abs(q - f) for q, f in zip(ll[label[b]], ll["full"], strict=True))
              for b in kinds[1:]}
    # speed: decode tokens/s, alternating, after a prompt of --kv-speed-context tokens
    speed_ids = ctx_ids[: args.kv_speed_context]
    rates = {label[b]: [] for b in kinds}
    for r in range(args.kv_repeats + 1):
        for bits in kinds[r % 3:] + kinds[: r % 3]:
            _set_kv(engine, bits)
            res = engine.generate(speed_ids, max_tokens=args.kv_speed_tokens, mode="plain")
            if r:  # the first round warms up
                rates[label[bits]].append(res.stats.generated_tokens / res.stats.decode_s)
    _set_kv(engine, None)
    med = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "context_tokens": args.kv_context, "kv_bytes": mem,
        "kv_bytes_per_token": {k: v / args.kv_context for k, v in mem.items()},
        "greedy_tokens": args.kv_gen, "prompts": len(prompts), "greedy_agreement": agree,
        "ll_tokens": len(ll_ids) - 1, "mean_loglik_full": statistics.fmean(ll["full"]),
        "mean_loglik_diff": ll_diff, "mean_abs_loglik_diff": ll_abs,
        "ppl": {k: math.exp(-statistics.fmean(v)) for k, v in ll.items()},
        "decode_tok_s": med, "decode_ratio": {k: med[k] / med["full"] for k in ("8-bit", "4-bit")},
        "speed_context": len(speed_ids), "speed_tokens": args.kv_speed_tokens, "speed_runs": rates,
    }


# --------------------------------------------------------------------------- report
def report(res: dict) -> None:
    mib = 2**20
    if "server" in res:
        s = res["server"]
        print(f"\n(a) growing conversation through the server: {s['turns']} turns, ~{s['turn_chars']} chars "
              f"added per turn, max_tokens {s['max_tokens']}; time to first token (ms)")
        names = s.get("servers", ["edgespec", "edgespec_no_reuse", "mlx_lm"])
        dr, ml = "edgespec_no_drafter_reuse" in names, "mlx_lm" in names
        print(f"{'turn':>4} {'prompt':>6} {'reuse':>7} {'cached':>6} "
              + (f"{'no drafter reuse':>16} {'reuse/no-dr':>11} " if dr else "")
              + f"{'no reuse':>9}" + (f" {'mlx-lm':>7} {'mlx cached':>10} {'reuse/mlx':>9}" if ml else ""))
        for r in s["per_turn"]:
            line = (f"{r['turn']:>4} {r['prompt_tokens'] or '?':>6} {r['edgespec_ttft_ms']:>7.0f} "
                    f"{r['edgespec_cached_tokens'] if r['edgespec_cached_tokens'] is not None else '?':>6} ")
            if dr:
                line += (f"{r['edgespec_no_drafter_reuse_ttft_ms']:>16.0f} "
                         f"{r['edgespec_vs_no_drafter_reuse']:>11.2f} ")
            line += f"{r['edgespec_no_reuse_ttft_ms']:>9.0f}"
            if ml:
                line += (f" {r['mlx_lm_ttft_ms']:>7.0f} "
                         f"{r['mlx_lm_cached_tokens'] if r['mlx_lm_cached_tokens'] is not None else '?':>10} "
                         f"{r['edgespec_vs_mlx_lm']:>9.2f}")
            print(line)
        if dr:
            print("  server-side prefill (ms; drafter's begin included) and the drafter's reused tokens:")
            for r in s["per_turn"]:
                print(f"  turn {r['turn']}: reuse {r['edgespec_prefill_ms']:.0f} "
                      f"(drafter reused {r['edgespec_drafter_cached_tokens']}), no drafter reuse "
                      f"{r['edgespec_no_drafter_reuse_prefill_ms']:.0f}, no reuse {r['edgespec_no_reuse_prefill_ms']:.0f}")
        print("last/first turn: " + ", ".join(f"{n} {s[f'{n}_last_over_first']:.2f}x" for n in names)
              + f"; same replies as edgespec-with-reuse: {s['same_replies']}")
    if "drafter" in res and "per_turn" in res["drafter"]:
        d = res["drafter"]
        print(f"\n(a2) the drafter's own prefill per turn, in-process ({d['drafter']}; median and range of "
              f"{d['repeats']} alternating runs, ms)")
        print(f"{'turn':>4} {'prompt':>6} {'from scratch':>18} {'with reuse':>16} {'positions run':>13}")
        for r in d["per_turn"]:
            f, u = r["fresh_ms"], r["reuse_ms"]
            print(f"{r['turn']:>4} {r['prompt_tokens']:>6} {statistics.median(f):>7.0f} ({min(f):.0f}-{max(f):.0f})"
                  f"{'':>2} {statistics.median(u):>6.0f} ({min(u):.0f}-{max(u):.0f}) {r['drafter_prefilled_with_reuse']:>13}")
    if "chat" in res:
        c = res["chat"]
        print(f"\n(b) edgespec chat ({c['command']}), stats line per turn:")
        for r in c["per_turn"]:
            print(f"  turn {r['turn']}: {r['reused']} of {r['prompt_tokens'] or '?'} prompt tokens reused, "
                  f"{r['tokens']} tokens at {r['tok_s']:.1f} tok/s")
    if "concurrency" in res:
        c = res["concurrency"]
        print(f"\n(c) {c['conversations']} conversations interleaved, --prompt-cache-bytes {c['prompt_cache_bytes']}: "
              "cached/prompt tokens per turn")
        for i, conv in enumerate(c["cached_tokens"]):
            print(f"  conversation {i + 1}: " + "  ".join(f"{x['cached']}/{x['prompt']}" for x in conv))
        for k, h in enumerate(c["health_after_round"]):
            print(f"  after round {k + 1}: {h['bytes'] / mib:.1f} of {h['max_bytes'] / mib:.1f} MiB, "
                  f"{h['blocks']} blocks, {h['evicted_blocks']} evicted, {h['hits']}/{h['lookups']} hits")
        rss = c["peak_rss_bytes"]
        print(f"  within budget after every round: {c['within_budget']}; server peak RSS (VmHWM) "
              f"{rss / mib:.0f} MiB" if rss else "  peak RSS: unavailable")
    if "kv" in res:
        k = res["kv"]
        print(f"\n(d) KV quantization, {k['context_tokens']}-token context:")
        print(f"{'cache':>6} {'KV MiB':>8} {'B/token':>8} {'agree':>6} {'dLL/token':>10} {'|dLL|':>7} "
              f"{'ppl':>7} {'decode tok/s':>12} {'ratio':>6}")
        for name in ("full", "8-bit", "4-bit"):
            ag = k["greedy_agreement"].get(name, {}).get("positionwise", 1.0)
            print(f"{name:>6} {k['kv_bytes'][name] / mib:>8.1f} {k['kv_bytes_per_token'][name]:>8.0f} {ag:>6.3f} "
                  f"{k['mean_loglik_diff'].get(name, 0.0):>10.4f} {k['mean_abs_loglik_diff'].get(name, 0.0):>7.4f} "
                  f"{k['ppl'][name]:>7.3f} {k['decode_tok_s'][name]:>12.1f} "
                  f"{k['decode_tok_s'][name] / k['decode_tok_s']['full']:>6.2f}")
        print(f"  agreement: greedy tokens equal position by position over {k['prompts']} prompts x "
              f"{k['greedy_tokens']} tokens; first divergence per prompt: "
              + "; ".join(f"{n} {v['first_divergence']}" for n, v in k["greedy_agreement"].items()))
        print(f"  dLL: mean log-prob difference per token (quantized - full) over {k['ll_tokens']} tokens "
              f"of a fixed text; decode after a {k['speed_context']}-token prompt, {k['speed_tokens']} tokens")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="bundle folder (default: the default model's bundle)")
    ap.add_argument("--drafter", default=None, help="--drafter for edgespec's server and chat (default: theirs)")
    ap.add_argument("--turns", type=int, default=8, help="turns of the growing conversation")
    ap.add_argument("--turn-chars", type=int, default=1300, help="characters of each user message")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per reply")
    ap.add_argument("--concurrency-turns", type=int, default=4, help="turns of each of the 4 conversations")
    ap.add_argument("--concurrency-cache-bytes", default="120M", help="--prompt-cache-bytes of the server in (c)")
    ap.add_argument("--kv-context", type=int, default=4096, help="context whose KV bytes are measured")
    ap.add_argument("--kv-gen", type=int, default=128, help="greedy tokens compared per prompt")
    ap.add_argument("--kv-prompts", type=int, default=3, help="prompts for greedy agreement")
    ap.add_argument("--kv-ll-tokens", type=int, default=1024, help="tokens of the fixed text (log-likelihood)")
    ap.add_argument("--kv-speed-context", type=int, default=512, help="prompt tokens before the decode timing")
    ap.add_argument("--kv-speed-tokens", type=int, default=32, help="tokens decoded per speed run")
    ap.add_argument("--kv-repeats", type=int, default=2, help="alternating speed runs per cache kind")
    ap.add_argument("--compare-drafter-reuse", action="store_true",
                    help="(a): also a server with prefix reuse on but the drafter's own cache not reused "
                         "(EDGESPEC_DRAFTER_REUSE=off): before/after the drafter's store, side by side")
    ap.add_argument("--no-mlx-lm", action="store_true", help="(a): leave mlx-lm's server out")
    ap.add_argument("--mode", default=None,
                    help="(a): decoding mode asked of edgespec's servers (default: theirs, auto; 'speculative' "
                         "drafts from the first step, so the drafter's prefill is in the time to first token)")
    ap.add_argument("--drafter-repeats", type=int, default=3, help="(a2): runs of each drafter prefill")
    ap.add_argument("--skip", default="", help="comma-separated parts to leave out: server,drafter,chat,concurrency,kv")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    parts = {"server", "drafter", "chat", "concurrency", "kv"}
    if skip - parts:
        ap.error(f"--skip: unknown part(s) {sorted(skip - parts)}")

    from edgespec.converters.default_model import default_bundle_path

    bundle = args.model or str(default_bundle_path())
    res: dict = {"model": bundle, "argv": sys.argv[1:]}
    t0 = time.perf_counter()
    for name, fn in (("server", bench_server), ("drafter", bench_drafter), ("chat", bench_chat),
                     ("concurrency", bench_concurrency), ("kv", bench_kv)):
        if name in skip:
            continue
        print(f"[{name}] ...", file=sys.stderr)
        t = time.perf_counter()
        res[name] = fn(args, bundle)
        res[name]["seconds"] = time.perf_counter() - t
        print(f"[{name}] {res[name]['seconds']:.0f} s", file=sys.stderr)
        if args.json:  # written after each part, so a long run interrupted keeps what it measured
            Path(args.json).write_text(json.dumps(res, indent=2))
    res["seconds"] = time.perf_counter() - t0
    report(res)
    print(f"\ntotal {res['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
