"""The corpus source: a frozen n-gram table of the verifier's own answers (edgespec.adaptive.corpus).

What it must do: propose what most often followed the longest matching context, never across
documents, and keep proposing only while the match is unanimous; read back only whole files of
its own vocabulary; and never change the output, greedy or sampled."""

import logging
import struct
import zlib
from collections import Counter

import numpy as np
import pytest
from conftest import make_paced_engine, make_tiny_engine, random_prompts
from stats_support import adaptive_continuations, continuation_law
from test_adaptive import chi2_pvalue

from edgespec.adaptive.corpus import (
    MAGIC,
    ORDERS,
    SHARE_BINS,
    CorpusError,
    CorpusTable,
    _hash_windows,
    _saturate,
    context_hash,
)
from edgespec.adaptive.policy import SeededPolicy
from edgespec.adaptive.sources import CorpusSource
from edgespec.engine import Engine, make_options
from edgespec.errors import ModelLoadError
from edgespec.logits.sampling import SamplingParams
from edgespec.modes import make_mode
from edgespec.weights.loader import LoadedModel


# ---------------------------------------------------------------- the table
def test_hash_of_a_window_is_the_hash_of_its_context():
    toks = np.array([5, 9, 2, 2, 7, 40000, 3], np.int64)
    for n in (2, 3, 8):
        if len(toks) >= n:
            got = _hash_windows(toks, n)
            assert [int(h) for h in got] == [context_hash(toks[i : i + n].tolist()) for i in range(len(toks) - n + 1)]


def test_the_most_frequent_continuation_wins_and_ties_take_the_smallest_id():
    docs = [[1, 2, 3, 9], [1, 2, 3, 9], [1, 2, 3, 4], [5, 6, 7], [5, 6, 8]]
    t = CorpusTable.build(docs)
    order, tok, unanimous, bucket = t.next_token([0, 1, 2, 3])
    # Longest match: (1, 2, 3), seen 3 times, followed by 9 twice: share 2/3 (bin 3), 3 occurrences.
    assert (order, tok, unanimous, bucket) == (3, 9, False, (3, 3, 3))
    assert t.next_token([5, 6])[1:3] == (7, False)  # 7 and 8 once each: the smaller id
    assert t.next_token([4, 4]) is None  # nothing matches two tokens


def test_chains_stop_where_the_match_splits_and_never_cross_documents():
    docs = [[10, 11, 12, 13, 14, 15], [20, 21, 12, 13, 30], [40, 41, 42]]
    t = CorpusTable.build(docs)
    # After (10, 11) the text is unanimous up to the document's end.
    assert t.chain([10, 11], 8) == ([12, 13, 14, 15], (2, 4, 1))
    # (21, 12) -> 13, then (21, 12, 13) -> 30, the longer match, unanimous though (12, 13)
    # alone went on with 14 once and 30 once.
    assert t.chain([21, 12], 8) == ([13, 30], (2, 4, 1))
    # (9, 12, 13): only (12, 13) matches, split between 14 and 30 (the smaller id first, share
    # 1/2: bin 2); the first step is proposed whatever its share, then (12, 13, 14) is unanimous.
    assert t.chain([9, 12, 13], 8) == ([14, 15], (2, 2, 2))
    # A split after the first step ends the chain: (1, 2) -> 3 twice, then (1, 2, 3) splits.
    t2 = CorpusTable.build([[1, 2, 3, 4], [1, 2, 3, 5]])
    assert t2.chain([1, 2], 8) == ([3], (2, 4, 2))
    assert t2.chain([0, 1, 2, 3], 8) == ([4], (3, 2, 2))
    # The end of one document is not followed by the start of the next.
    assert t.chain([14, 15], 8) == ([], None)
    assert t.chain([41, 42], 8) == ([], None)
    assert t.chain([10, 11], 2)[0] == [12, 13]  # k bounds it


def test_file_round_trip_and_every_damage_is_refused(tmp_path):
    docs = [list(np.random.default_rng(i).integers(1, 50, 40)) for i in range(30)]
    t = CorpusTable.build(docs, vocab_hash="v1", starts=[5] * 30)
    assert t.priors and all(k.startswith("corpus:") and 0 <= v <= 1 for k, v in t.priors.items())
    path = tmp_path / "corpus.bin"
    t.save(path)
    back = CorpusTable.load(path, "v1")
    assert back.priors == t.priors and back.vocab_hash == "v1"
    for n in ORDERS:
        for a, b in zip(t.tables[n], back.tables[n], strict=True):
            assert np.array_equal(a, b)
    seq = docs[3][:10]
    assert back.chain(seq, 8) == t.chain(seq, 8)
    data = path.read_bytes()
    with pytest.raises(CorpusError, match="another vocabulary"):
        CorpusTable.load(path, "v2")
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    for bad, why in ((bytes(flipped), "checksum"), (data[:-9], "checksum"), (b"nope" + data, "not an edgespec"),
                     (b"", "not an edgespec")):
        with pytest.raises(CorpusError, match=why):
            CorpusTable.from_bytes(bad)
    assert not list(tmp_path.glob(".*tmp*"))  # the atomic save left no temp file
    # A file whose checksum holds but whose contents could not be used (a crafted one): refused.
    for n, arr, value in ((2, 3, 0), (3, 2, 0), (4, 2, 60000)):
        tables = {k: tuple(a.copy() for a in v) for k, v in t.tables.items()}
        # a context seen 0 times (a division by zero), a top token seen 0 times, a top token
        # seen more often than its context
        tables[n][arr][0] = value
        with pytest.raises(CorpusError, match="out of range"):
            CorpusTable.from_bytes(CorpusTable(tables, "v1").to_bytes())
    tables = {k: tuple(a.copy() for a in v) for k, v in t.tables.items()}
    tables[5][0][1] = tables[5][0][0]  # a key twice: not strictly increasing
    with pytest.raises(CorpusError, match="not sorted"):
        CorpusTable.from_bytes(CorpusTable(tables, "v1").to_bytes())


def _recrc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def test_the_file_is_10_bytes_a_context_and_loads_as_views(tmp_path):
    docs = [list(np.random.default_rng(i).integers(1, 49152, 60)) for i in range(25)]
    t = CorpusTable.build(docs, vocab_hash="v", vocab_size=49152)
    assert t.ids == "u2" and t.nbytes == 10 * len(t)
    for keys, top, topc, total in t.tables.values():
        assert (keys.dtype, top.dtype, topc.dtype, total.dtype) == (np.uint32, np.uint16, np.uint16, np.uint16)
    data = t.to_bytes()
    assert len(data) - 10 * len(t) < 2048  # magic, header (priors included), checksum
    back = CorpusTable.from_bytes(data)
    assert back.nbytes == t.nbytes
    for arrs in back.tables.values():  # read-only views of the file's bytes, aligned: no copy made
        assert all(not a.flags.owndata and not a.flags.writeable and a.flags.aligned for a in arrs)
    seq = docs[7][:12]
    assert back.chain(seq, 8) == t.chain(seq, 8)


def test_a_format_1_file_is_refused_with_a_rebuild_hint(tmp_path, caplog):
    t = CorpusTable.build([[1, 2, 3, 4]] * 3)
    old = _recrc(b"ESCORP1\n" + t.to_bytes()[len(MAGIC) : -4])  # whole, checksum right: an older format
    with pytest.raises(CorpusError, match="older corpus format.*rebuild") as e:
        CorpusTable.from_bytes(old, name="corpus.bin")
    assert "\n" not in str(e.value)  # one line, like every other refusal
    loaded = make_tiny_engine().loaded
    path = tmp_path / "old.bin"
    path.write_bytes(old)
    with pytest.raises(ModelLoadError, match="corpus: .*older corpus format"):
        Engine(loaded, corpus=str(path))
    bundle = tmp_path / "bundle"  # found automatically: a warning, and no corpus
    bundle.mkdir()
    (bundle / "corpus.bin").write_bytes(old)
    eng = Engine(LoadedModel(loaded.model, loaded.tokenizer, bundle))
    with caplog.at_level(logging.WARNING, logger="edgespec.engine"):
        assert eng.corpus_table is None
    assert "older corpus format" in caplog.text
    from edgespec.converters.distill.corpus import _is_corpus

    assert _is_corpus(path)  # the build command may replace it (not a foreign file)


def test_ids_are_u32_for_a_large_vocabulary_and_never_wrap():
    docs = [[70000, 5, 65536, 151000, 7]] * 3 + [[70000, 5, 65536, 9]]
    t = CorpusTable.build(docs, vocab_size=152064)
    assert t.ids == "u4" and t.tables[2][1].dtype == np.uint32 and t.nbytes == 12 * len(t)
    back = CorpusTable.from_bytes(t.to_bytes())
    assert back.ids == "u4" and back.max_token == 151000
    assert back.next_token([70000, 5])[1] == 65536 and back.chain([5, 65536], 2)[0] == [151000, 7]
    assert CorpusTable.build([[1, 2, 3]], vocab_size=65536).ids == "u2"  # the largest id, 65535, fits
    assert CorpusTable.build([[1, 2, 3]], vocab_size=65537).ids == "u4"
    assert CorpusTable.build([[1, 2, 70000]]).ids == "u4"  # no size given: the largest id decides
    with pytest.raises(ValueError, match="outside the vocabulary"):
        CorpusTable.build([[1, 2, 49152]], vocab_size=49152)
    with pytest.raises(ValueError, match="negative"):
        CorpusTable.build([[1, -2, 3]])
    # A table whose ids do not fit its declared dtype is refused when written, never wrapped.
    tables = {n: tuple(a.copy() for a in v) for n, v in t.tables.items()}
    with pytest.raises(ValueError, match="token ids outside"):
        CorpusTable(tables, ids="u2").to_bytes()
    # A header that declares another dtype (or none) is refused.
    data = t.to_bytes()
    (hl,) = struct.unpack_from("<I", data, len(MAGIC))
    header = data[len(MAGIC) + 4 : len(MAGIC) + 4 + hl]
    for ids in (b'"u8"', b'"i2"', b"null"):
        forged = header.replace(b'"u4"', ids)
        forged += b" " * (len(header) - len(forged))
        with pytest.raises(CorpusError, match="unreadable header"):
            CorpusTable.from_bytes(_recrc(data[: len(MAGIC) + 4] + forged + data[len(MAGIC) + 4 + hl : -4]))
    # Declaring u2 over u4 arrays: the sizes no longer match.
    forged = header.replace(b'"u4"', b'"u2"')
    with pytest.raises(CorpusError, match="sizes do not match"):
        CorpusTable.from_bytes(_recrc(data[: len(MAGIC) + 4] + forged + data[len(MAGIC) + 4 + hl : -4]))


def test_counts_saturate_keeping_unanimity_and_the_share_bin():
    rng = np.random.default_rng(0)
    total = np.concatenate([rng.integers(1, 1 << 31, 5000), rng.integers(65530, 65540, 200), [65535, 65536, 10**9]])
    topc = np.maximum((total * rng.random(len(total))).astype(np.int64), 1)
    topc[:300] = total[:300]  # unanimous ones
    topc[300:400] = 1  # a top token seen once among many
    c, t = _saturate(topc, total)
    assert c.dtype == t.dtype == np.uint16
    c, t, c0, t0 = c.astype(np.int64), t.astype(np.int64), topc, total
    assert np.all(t == np.minimum(t0, 65535)) and np.all((c >= 1) & (c <= t))
    assert np.array_equal(c == t, c0 == t0)  # unanimous before iff after
    share = lambda c, t: np.minimum(c * SHARE_BINS // t, SHARE_BINS - 1)  # noqa: E731
    assert np.array_equal(share(c, t), share(c0, t0))  # the bucket's share bin
    assert np.array_equal(np.minimum(t, 3), np.minimum(t0, 3))
    # Built: (1, 2) followed by 3 70,000 times and by 4 30,000 times.
    doc = [1, 2, 3] * 70000 + [1, 2, 4] * 30000
    table = CorpusTable.build([doc])
    _, topc2, total2 = (a[np.searchsorted(table.tables[2][0], context_hash([1, 2]))] for a in table.tables[2][1:])
    assert (int(topc2), int(total2)) == (70000 * 65535 // 100000, 65535)
    back = CorpusTable.from_bytes(table.to_bytes())
    assert back.next_token([0, 1, 2]) == (2, 3, False, (2, 3, 3))  # share 0.7: bin 3, as unsaturated
    assert back.next_token([3, 1]) == (2, 2, True, (2, 4, 3))  # seen 99,999 times, always 2


def test_a_32_bit_key_collision_at_build_merges_the_contexts():
    # Birthday search: 2-token contexts until two different ones share a 32-bit key.
    rng = np.random.default_rng(5)
    pairs = rng.integers(0, 49152, (300000, 2))
    keys = _hash_windows(pairs.reshape(-1), 2)[::2]
    assert [int(k) for k in keys[:3]] == [context_hash(p.tolist()) for p in pairs[:3]]
    order = np.argsort(keys, kind="stable")
    same = np.flatnonzero((keys[order][1:] == keys[order][:-1])
                          & np.any(pairs[order][1:] != pairs[order][:-1], axis=1))
    assert len(same)  # about 300000^2 / 2^33 = 10 expected
    a, b = pairs[order[same[0]]].tolist(), pairs[order[same[0] + 1]].tolist()
    assert a != b and context_hash(a) == context_hash(b)
    docs = [a + [7], a + [7], b + [9], [100, 101, 102], [103, 104, 105]]
    t = CorpusTable.build(docs)
    keys2 = t.tables[2][0]
    assert np.all(keys2[1:] > keys2[:-1])  # still unique and strictly increasing
    assert len(keys2) == 3  # a and b are one entry, then (100, 101) and (103, 104)
    # One entry: the most frequent token after either (7, twice of three), not unanimous.
    assert t.next_token(a) == t.next_token(b) == (2, 7, False, (2, 3, 3))
    back = CorpusTable.from_bytes(t.to_bytes())  # and the loader's check passes
    assert back.next_token(b) == (2, 7, False, (2, 3, 3))


# ---------------------------------------------------------------- the engine
def test_engine_finds_checks_or_skips_its_corpus(tmp_path, caplog):
    loaded = make_tiny_engine().loaded
    t = CorpusTable.build([[1, 2, 3, 4]] * 3)
    assert Engine(loaded, corpus=t).corpus_table is t
    assert Engine(loaded, corpus="off").corpus_table is None
    assert Engine(loaded).corpus_table is None  # a model without a path ships none
    # A given path is read before any request; a damaged one is a one-line load error.
    good = tmp_path / "good.bin"
    t.save(good)
    assert Engine(loaded, corpus=str(good)).corpus_table.tables.keys() == t.tables.keys()
    bad = tmp_path / "bad.bin"
    bad.write_bytes(good.read_bytes()[:-1])
    with pytest.raises(ModelLoadError, match="corpus: .*checksum"):
        Engine(loaded, corpus=str(bad))
    big = tmp_path / "big.bin"  # a whole file whose tokens this model does not have
    CorpusTable.build([[1, 2, 3, loaded.model.args.vocab_size + 5]] * 3).save(big)
    with pytest.raises(ModelLoadError, match="outside this model's vocabulary"):
        Engine(loaded, corpus=str(big))
    # Found beside the model (its bundle folder): a damaged one is skipped with a warning.
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "corpus.bin").write_bytes(MAGIC + b"\0" * 20)
    eng = Engine(LoadedModel(loaded.model, loaded.tokenizer, bundle))
    with caplog.at_level(logging.WARNING, logger="edgespec.engine"):
        assert eng.corpus_table is None
    assert "corpus not used" in caplog.text
    (bundle / "corpus.bin").write_bytes(good.read_bytes())
    eng = Engine(LoadedModel(loaded.model, loaded.tokenizer, bundle))
    assert eng.corpus_table is not None


def test_corpus_option_is_a_source_and_can_be_left_out():
    engine = make_tiny_engine()
    engine.corpus = CorpusTable.build([[1, 2, 3, 4, 5]] * 2)
    names = [s.name for s in make_mode("adaptive", engine, make_options(mode="adaptive")).sources]
    assert "corpus" in names
    names = [s.name for s in make_mode("adaptive", engine, make_options(mode="adaptive", sources="context")).sources]
    assert names == ["context"]


# ---------------------------------------------------------------- lossless
@pytest.fixture(scope="module")
def corpus_engine():
    """A paced tiny engine whose corpus holds its own greedy replies to other prompts."""
    engine = make_paced_engine(0, 0.003, scale=3.0)
    engine.history = None
    train = random_prompts(40, seed=11)
    docs = [p + engine.generate(p, max_tokens=32, mode="plain").tokens for p in train]
    engine.corpus = CorpusTable.build(docs, starts=[len(p) for p in train])
    prompts = random_prompts(12, seed=4)
    refs = [engine.generate(p, max_tokens=24, mode="plain").tokens for p in prompts]
    return engine, prompts, refs


@pytest.mark.parametrize("sources", ["corpus", "context+corpus", "auto"])
def test_greedy_with_the_corpus_equals_plain(corpus_engine, sources):
    engine, prompts, refs = corpus_engine
    used = Counter()
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        # Timed (as shipped), then under seeded decisions: trees of every shape, the corpus's
        # chains verified whatever their price, so the test does not hang on the machine's timing.
        for policy in (None, SeededPolicy(i)):
            engine.policy = policy
            try:
                r = engine.generate(p, max_tokens=24, mode="adaptive", sources=sources)
            finally:
                engine.policy = None
            assert r.tokens == ref, (sources, p, policy and policy.decisions)
            used.update(r.stats.accepted_by_source)
    if sources == "corpus":  # (beside the context source, the tiny model's loops are the context's)
        assert used["corpus"] > 0, used  # its chains were verified and kept


def test_seeded_sampling_with_the_corpus_equals_plain(corpus_engine):
    engine, prompts, _ = corpus_engine
    for i, p in enumerate(prompts[:6]):
        kw = dict(max_tokens=24, temperature=0.9, top_p=0.95, seed=300 + i)
        ref = engine.generate(p, mode="plain", **kw).tokens
        assert engine.generate(p, mode="adaptive", sources="context+corpus", **kw).tokens == ref


def test_sampling_with_the_corpus_follows_the_verifier_law():
    """Chi-square of 3-token continuations against the law enumerated from the model, with the
    corpus the only source (its chains: what the model sampled before)."""
    params = dict(temperature=1.0, top_k=3)
    engine = make_paced_engine(1, 0.002, scale=1.5, vocab_size=8)
    engine.history = None
    prompt = [1, 2, 3] * 4 + [1, 2]
    docs = [prompt + engine.generate(prompt, max_tokens=6, mode="plain", seed=s, **params).tokens
            for s in range(30)]
    engine.corpus = CorpusTable.build(docs)
    n = 3
    law = continuation_law(engine.model, prompt, SamplingParams(**params), n)
    opts = make_options(mode="adaptive", sources="corpus", **params)
    runs = 500
    counts, accepted = adaptive_continuations(engine, prompt, opts, params, n, runs)
    assert accepted > runs // 10  # corpus chains were verified and kept
    p = chi2_pvalue(counts, law)
    assert p > 1e-3, p


def test_the_source_declares_the_priors_measured_at_build():
    t = CorpusTable.build([[1, 2, 3]] * 2)
    t.priors = {"corpus:(2, 4, 2)": 0.9}
    src = CorpusSource(t)
    assert src.priors["corpus:(2, 4, 2)"] == 0.9 and src.priors["corpus"] == 0.15
    assert src.propose([1, 2], 3, 16)[0].tokens == [3]
    assert src.propose([1, 2], 0, 16) == []


# ---------------------------------------------------------------- building one alone
def test_corpus_command_drops_overlapping_prompts_and_never_overwrites_a_foreign_file(tmp_path, capsys):
    import json

    from conftest import write_tiny_bundle
    from edgespec.converters.distill.corpus import main

    bundle = write_tiny_bundle(tmp_path / "verifier", seed=2, scale=3.0)
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": p, "domain": "chat"}) for p in (
        "how do plants make food from light", "name three big cities", "abc xyz hello", "why is the sky blue today")))
    bench = tmp_path / "bench.jsonl"  # the bench format: a chat
    bench.write_text(json.dumps({"messages": [{"role": "user", "content": "Why is the sky blue today? Explain."}]}))
    foreign = tmp_path / "notes.bin"
    foreign.write_bytes(b"mine")
    argv = ["--verifier", str(bundle), "--data", str(data), "--exclude", str(bench), "--max-new", "6",
            "--batch-size", "2"]
    assert main(argv + ["--out", str(foreign)]) == 2
    assert foreign.read_bytes() == b"mine" and "not an edgespec corpus" in capsys.readouterr().err
    out = tmp_path / "corpus.bin"
    assert main(argv + ["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "3 of 4 prompts kept (1 overlap --exclude)" in err
    import edgespec

    engine = edgespec.load(bundle, drafter="none", progress=False)
    table = CorpusTable.load(out, engine.loaded.tokenizer.vocab_hash())
    assert len(table) > 0
    assert main(argv + ["--out", str(out)]) == 0  # its own file: replaced (answers reused from the work folder)
