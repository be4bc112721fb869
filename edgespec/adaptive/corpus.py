"""A frozen n-gram table of the verifier's own answers: drafts for free text at no model cost.

Why: on free text (chat, summaries, prose around code) the request's own n-grams rarely
repeat, and a drafter costs real time per token (on the 2-core CPU the shipped distilled
drafter's token is about a tenth of a verifier step, plus its catch-up). A small model's
answers are formulaic, though ("Here's a Python function that ...", "```python\\ndef"), and
the verifier's own greedy answers to many prompts say what it tends to write next. This
table holds, for every context of ORDERS tokens seen in those answers, the token that most
often followed and how often (REST, He et al. 2023, drafts from a datastore the same way;
here the datastore is the verifier's own output, so its habits are what is matched).

`chain(seq, k)` backs off from the longest order to the shortest (2) at every step and follows the most
frequent next token; the first step's order and share (top count / all counts) are the
bucket the decoder learns acceptance under. Proposals are only drafts: every token is
verified, so the table can never change the output, only the speed.

Built by `edgespec distill` from its greedy data (converters/distill/corpus.py) and shipped
for the default model beside its drafter (`corpus.bin`). On disk (read back, so checked):

    MAGIC, u32 header length, JSON header {"format", "vocab_hash", "orders", "sizes"},
    then per order: keys u64[n], top i32[n], top_count u32[n], total u32[n] (keys sorted),
    then a CRC-32 of everything before it (u32).

A file that is not whole (bad magic, CRC, sizes) or was built for another vocabulary is
refused with CorpusError; the engine then drafts without it and says why once.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np

from edgespec.safe_write import temp_prefix

MAGIC = b"ESCORP1\n"
FORMAT = "edgespec-corpus"
FILENAME = "corpus.bin"
ORDERS = (2, 3, 4, 5, 6, 8)  # context lengths indexed (a chain step needs at least 2 matching)
P = 0x100000001B3  # FNV-1a's 64-bit prime, as a polynomial base
MASK = (1 << 64) - 1
SHARE_BINS = 5  # the first step's share of its context, binned for the bucket
HELDOUT_EVERY = 10  # build: every 10th document measures the priors of a table without it
PRIOR_MIN = 20  # held-out first steps a bucket needs before its measured rate is kept
MAX_FILE = 1 << 30  # refuse to read anything larger (a corpus of a few MB is typical)


class CorpusError(ValueError):
    """The corpus file is damaged or belongs to another vocabulary."""


def context_hash(ctx) -> int:
    """The key of a context (a sequence of token ids); same value as `_hash_windows`."""
    h = len(ctx)
    for t in ctx:
        h = (h * P + int(t) + 1) & MASK
    return h


def _hash_windows(tokens: np.ndarray, n: int) -> np.ndarray:
    """Keys of every window of n tokens (row i: tokens[i:i+n]), vectorised."""
    w = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.uint64), n)
    h = np.full(len(w), n, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(P) + w[:, j] + np.uint64(1)
    return h


def _tables(docs: list[np.ndarray], orders) -> dict:
    """Per order n: (keys, top token, its count, all counts) of every n-token context."""
    tables = {}
    for n in orders:
        keys, nxt = [], []
        for d in docs:
            if len(d) > n:
                keys.append(_hash_windows(d[:-1], n))
                nxt.append(d[n:])
        if not keys:
            e = np.zeros(0, np.uint64)
            tables[n] = (e, np.zeros(0, np.int32), np.zeros(0, np.uint32), np.zeros(0, np.uint32))
            continue
        k, t = np.concatenate(keys), np.concatenate(nxt).astype(np.int32)
        order = np.lexsort((t, k))  # by key, then token
        k, t = k[order], t[order]
        new_pair = np.ones(len(k), bool)
        new_pair[1:] = (k[1:] != k[:-1]) | (t[1:] != t[:-1])
        starts = np.flatnonzero(new_pair)
        pk, pt = k[starts], t[starts]
        pc = np.diff(np.append(starts, len(k))).astype(np.int64)
        # Per key: the most frequent token (ties: the smallest id), and the total count.
        o = np.lexsort((pt, -pc, pk))
        pk, pt, pc = pk[o], pt[o], pc[o]
        head = np.ones(len(pk), bool)
        head[1:] = pk[1:] != pk[:-1]
        heads = np.flatnonzero(head)
        total = np.add.reduceat(pc, heads)
        tables[n] = (pk[heads], pt[heads], pc[heads].astype(np.uint32), total.astype(np.uint32))
    return tables


class CorpusTable:
    """Per order: sorted context keys with the most frequent next token and its counts."""

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
                 vocab_hash: str | None = None, priors: dict[str, float] | None = None):
        self.tables = {n: tables[n] for n in sorted(tables)}
        self.priors = dict(priors or {})  # first-step acceptance by bucket, measured at build
        self.orders = tuple(sorted(self.tables, reverse=True))
        self.vocab_hash = vocab_hash
        self.lookups = 0
        self.hits = 0

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, docs, vocab_hash: str | None = None, starts=None, orders=ORDERS) -> CorpusTable:
        """From documents (token id sequences); no context crosses a document's end.

        The priors: every HELDOUT_EVERY-th document is held out of a first table, and the
        first step's acceptance per bucket is measured on the held-out documents' tokens
        from `starts[i]` on (the answers; default: all); buckets seen PRIOR_MIN times keep
        their rate. The table kept is then built from every document."""
        docs = [np.asarray(d, np.int64) for d in docs]
        starts = list(starts) if starts is not None else [1] * len(docs)
        priors: dict[str, float] = {}
        if len(docs) >= 2 * HELDOUT_EVERY:
            held = set(range(0, len(docs), HELDOUT_EVERY))
            first = cls(_tables([d for i, d in enumerate(docs) if i not in held], orders))
            seen: dict[tuple, list[int]] = {}
            for i in sorted(held):
                d = docs[i].tolist()
                for j in range(max(1, starts[i]), len(d)):
                    r = first.next_token(d[max(0, j - max(orders)) : j])
                    if r is not None:
                        seen.setdefault(r[3], []).append(int(r[1] == d[j]))
            priors = {f"corpus:{b}": round(sum(v) / len(v), 3) for b, v in sorted(seen.items())
                      if len(v) >= PRIOR_MIN}
        return cls(_tables(docs, orders), vocab_hash, priors)

    # ------------------------------------------------------------------ looking up
    def next_token(self, ctx) -> tuple[int, int, bool, tuple[int, int, int]] | None:
        """(order, token, unanimous, bucket) of the longest indexed context ending ctx, or
        None. unanimous: every occurrence of the context went on with that token; bucket:
        (order, share of the top token binned 0..SHARE_BINS-1, occurrences capped at 3)."""
        self.lookups += 1
        for n in self.orders:
            if len(ctx) < n:
                continue
            keys, top, topc, total = self.tables[n]
            h = context_hash(ctx[-n:])
            i = int(np.searchsorted(keys, np.uint64(h)))
            if i < len(keys) and int(keys[i]) == h:
                self.hits += 1
                c, t = int(topc[i]), int(total[i])
                return n, int(top[i]), c == t, (n, min(c * SHARE_BINS // t, SHARE_BINS - 1), min(t, 3))
        return None

    def chain(self, seq, k: int) -> tuple[list[int], tuple[int, int, int] | None]:
        """Up to k tokens following seq: the most frequent token after the longest match, then
        more only while the match is unanimous (measured: longer chains past a split add
        verifier width, not accepted tokens); with the first step's bucket (see next_token)."""
        width = max(self.orders, default=0)
        ctx = [int(x) for x in seq[-width:]] if width else []
        out: list[int] = []
        bucket = None
        for _ in range(k):
            r = self.next_token(ctx)
            if r is None:
                break
            _, tok, unanimous, b = r
            if bucket is None:
                bucket = b
            elif not unanimous:
                break
            out.append(tok)
            ctx = ctx[1:] + [tok] if len(ctx) >= width else ctx + [tok]
        return out, bucket

    @property
    def max_token(self) -> int:
        """The largest token id it can propose (-1 when empty): checked against the model's
        vocabulary before use."""
        return max((int(t[1].max()) for t in self.tables.values() if len(t[1])), default=-1)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for t in self.tables.values() for a in t)

    def __len__(self) -> int:
        return sum(len(t[0]) for t in self.tables.values())

    # ------------------------------------------------------------------ file
    def to_bytes(self) -> bytes:
        header = {"format": FORMAT, "vocab_hash": self.vocab_hash, "priors": self.priors, "orders": list(self.tables),
                  "sizes": [len(t[0]) for t in self.tables.values()]}
        hj = json.dumps(header, sort_keys=True).encode()
        parts = [MAGIC, struct.pack("<I", len(hj)), hj]
        for keys, top, topc, total in self.tables.values():
            parts += [keys.astype("<u8").tobytes(), top.astype("<i4").tobytes(),
                      topc.astype("<u4").tobytes(), total.astype("<u4").tobytes()]
        body = b"".join(parts)
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes, vocab_hash: str | None = None, name: str = "corpus") -> CorpusTable:
        if len(data) < len(MAGIC) + 8 or not data.startswith(MAGIC):
            raise CorpusError(f"{name}: not an edgespec corpus file")
        body, crc = data[:-4], struct.unpack("<I", data[-4:])[0]
        if zlib.crc32(body) != crc:
            raise CorpusError(f"{name}: checksum mismatch (damaged or truncated)")
        (hl,) = struct.unpack_from("<I", body, len(MAGIC))
        off = len(MAGIC) + 4
        try:
            header = json.loads(body[off : off + hl])
            orders, sizes = [int(n) for n in header["orders"]], [int(s) for s in header["sizes"]]
        except (ValueError, KeyError, TypeError) as e:
            raise CorpusError(f"{name}: unreadable header ({e})") from None
        if header.get("format") != FORMAT or len(orders) != len(sizes) or any(n < 1 for n in orders):
            raise CorpusError(f"{name}: unreadable header")
        if vocab_hash is not None and header.get("vocab_hash") not in (None, vocab_hash):
            raise CorpusError(f"{name}: built for another vocabulary ({header.get('vocab_hash')})")
        off += hl
        if off + 20 * sum(sizes) != len(body):
            raise CorpusError(f"{name}: sizes do not match the file")
        tables = {}
        for n, s in zip(orders, sizes, strict=True):
            arrs = []
            for dt in ("<u8", "<i4", "<u4", "<u4"):
                a = np.frombuffer(body, dt, s, off)
                off += a.nbytes
                arrs.append(a.astype(dt[1:]))
            if s > 1 and not bool(np.all(arrs[0][1:] > arrs[0][:-1])):
                raise CorpusError(f"{name}: keys of order {n} are not sorted")
            if s and (arrs[1].min() < 0 or arrs[2].min() < 1 or bool(np.any(arrs[3] < arrs[2]))):
                raise CorpusError(f"{name}: counts or token ids of order {n} out of range")
            tables[n] = tuple(arrs)
        priors = header.get("priors") or {}
        if not isinstance(priors, dict) or not all(
                isinstance(k, str) and k.startswith("corpus:") and isinstance(v, (int, float)) and 0 <= v <= 1
                for k, v in priors.items()):
            raise CorpusError(f"{name}: unreadable priors")
        return cls(tables, header.get("vocab_hash"), priors)

    @classmethod
    def load(cls, path: str | Path, vocab_hash: str | None = None) -> CorpusTable:
        path = Path(path)
        size = path.stat().st_size
        if size > MAX_FILE:
            raise CorpusError(f"{path}: {size} bytes, more than a corpus file holds")
        return cls.from_bytes(path.read_bytes(), vocab_hash, str(path))

    def save(self, path: str | Path) -> None:
        """Written to a temp file beside it and renamed over it (never half-written)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path), dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.to_bytes())
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
