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
for the default model beside its drafter (`corpus.bin`). On disk (read back, so checked),
10 bytes a context with a vocabulary of up to 65,536 ids (12 above), little-endian:

    MAGIC, u32 header length, JSON header {"format", "vocab_hash", "priors", "orders",
    "sizes", "ids"} padded with spaces so the arrays start 8-byte aligned, then keys u32[n]
    of every order (each order's sorted, strictly increasing), top u16/u32[n] of every order
    ("ids": "u2" or "u4"), top_count u16[n] of every order, total u16[n] of every order, then
    a CRC-32 of everything before it (u32). Loaded, the arrays are read-only views of the
    file's bytes (no copy: the table takes its file's size in memory).

Format 2 (ESCORP2) halves format 1's 20 bytes a context (u64 keys, i32 ids, u32 counts):
32-bit keys (a false match only drafts a wrong token, see `context_hash`), 16-bit ids where
the vocabulary allows, counts saturated at 65,535 (see `_saturate`). A format 1 file is
refused like any other foreign file, with a message that says to rebuild it.

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

MAGIC = b"ESCORP2\n"
OLD_MAGICS = (b"ESCORP1\n",)  # earlier formats of this file: refused, with a rebuild hint
FORMAT = "edgespec-corpus"
FILENAME = "corpus.bin"
ORDERS = (2, 3, 4, 5, 6, 8)  # context lengths indexed (a chain step needs at least 2 matching)
P = 0x100000001B3  # FNV-1a's 64-bit prime, as a polynomial base
MASK = (1 << 64) - 1
MIX = 0x9E3779B97F4A7C15  # odd 64-bit multiplier: the key is the top 32 bits of hash * MIX
ID_DTYPES = {"u2": np.uint16, "u4": np.uint32}  # token ids: u2 while the vocabulary fits
COUNT_MAX = 0xFFFF  # counts are u16, saturated at build (see _saturate)
SHARE_BINS = 5  # the first step's share of its context, binned for the bucket
HELDOUT_EVERY = 10  # build: every 10th document measures the priors of a table without it
PRIOR_MIN = 20  # held-out first steps a bucket needs before its measured rate is kept
MAX_FILE = 1 << 30  # refuse to read anything larger (a corpus of a few MB is typical)
assert COUNT_MAX % SHARE_BINS == 0  # _saturate keeps every share bin exactly because of it


class CorpusError(ValueError):
    """The corpus file is damaged or belongs to another vocabulary."""


def context_hash(ctx) -> int:
    """The 32-bit key of a context (a sequence of token ids); same value as `_hash_windows`.

    A 64-bit polynomial hash of the ids, then the top 32 bits of its product with an odd
    constant (every bit of the 64-bit hash moves them). Only the key is stored, so a context
    absent from order n's table matches one of its S_n keys with probability about
    S_n / 2^32 (the default model's largest order holds about 2e5: 5e-5 a look-up and order,
    under 3e-4 over the six orders). A false match only proposes a wrong draft, which the
    verifier rejects like any other: the output never changes, a round may draft in vain.
    Two contexts of one order that share a key at build are one context (see `_tables`)."""
    h = len(ctx)
    for t in ctx:
        h = (h * P + int(t) + 1) & MASK
    return ((h * MIX) & MASK) >> 32


def _hash_windows(tokens: np.ndarray, n: int) -> np.ndarray:
    """Keys (u32) of every window of n tokens (row i: tokens[i:i+n]), vectorised."""
    w = np.lib.stride_tricks.sliding_window_view(tokens.astype(np.uint64), n)
    h = np.full(len(w), n, np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * np.uint64(P) + w[:, j] + np.uint64(1)
        h = (h * np.uint64(MIX)) >> np.uint64(32)
    return h.astype(np.uint32)


def _saturate(topc: np.ndarray, total: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Counts as u16. A context seen more than COUNT_MAX times keeps total = COUNT_MAX and
    its top token's count scaled down with it, floor(top * COUNT_MAX / total) but at least 1,
    rather than both clipped (which would make a 70,000-of-100,000 context look unanimous).
    Everything a look-up reads from the counts stays what it was: unanimity (top == total
    before iff after), the share bin (COUNT_MAX = 5 x 13,107, so floor(5 x scaled / COUNT_MAX)
    = floor(5 x top / total) exactly; a scaled count raised to 1 was in bin 0 and stays
    there) and the occurrences bucket (capped at 3). So do the priors measured at build."""
    topc, total = topc.astype(np.int64), total.astype(np.int64)
    big = total > COUNT_MAX
    if big.any():
        topc = topc.copy()
        topc[big] = np.maximum(topc[big] * COUNT_MAX // total[big], 1)
        total = np.minimum(total, COUNT_MAX)
    return topc.astype(np.uint16), total.astype(np.uint16)


def _tables(docs: list[np.ndarray], orders, ids: str = "u4") -> dict:
    """Per order n: (keys, top token, its count, all counts) of every n-token context, as
    stored (u32 keys, `ids` token ids, u16 counts).

    Two different contexts of one order whose 32-bit keys collide (about S^2 / 2^33 pairs
    among S contexts: a few in the default model's table) are merged: their occurrences are
    counted under the one key, which then proposes the most frequent token after either (and
    is rarely unanimous, so chains stop there). The keys stay unique and strictly increasing,
    which the loader checks."""
    tables = {}
    dt = ID_DTYPES[ids]
    for n in orders:
        keys, nxt = [], []
        for d in docs:
            if len(d) > n:
                keys.append(_hash_windows(d[:-1], n))
                nxt.append(d[n:])
        if not keys:
            e = np.zeros(0, np.uint16)
            tables[n] = (np.zeros(0, np.uint32), np.zeros(0, dt), e, e.copy())
            continue
        k, t = np.concatenate(keys), np.concatenate(nxt).astype(np.int64)
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
        tables[n] = (pk[heads], pt[heads].astype(dt), *_saturate(pc[heads], total))
    return tables


class CorpusTable:
    """Per order: sorted context keys with the most frequent next token and its counts."""

    def __init__(self, tables: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]],
                 vocab_hash: str | None = None, priors: dict[str, float] | None = None, ids: str | None = None):
        """tables: per order (keys u32, top token, its count, all counts), keys strictly
        increasing. ids: how token ids are stored ("u2", "u4"; default: "u2" while every id
        fits)."""
        self.tables = {n: tables[n] for n in sorted(tables)}
        if ids is None:
            top = max((int(t[1].max()) for t in self.tables.values() if len(t[1])), default=-1)
            ids = "u2" if top <= 0xFFFF else "u4"
        if ids not in ID_DTYPES:
            raise ValueError(f"token ids stored as {ids!r}: one of {sorted(ID_DTYPES)}")
        self.ids = ids
        self.priors = dict(priors or {})  # first-step acceptance by bucket, measured at build
        self.orders = tuple(sorted(self.tables, reverse=True))
        self.vocab_hash = vocab_hash
        self.lookups = 0
        self.hits = 0

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, docs, vocab_hash: str | None = None, starts=None, orders=ORDERS,
              vocab_size: int | None = None) -> CorpusTable:
        """From documents (token id sequences); no context crosses a document's end.

        vocab_size: the model's (default: the largest id seen + 1); ids are stored as u16
        when it is at most 65,536, else u32, and an id outside it (or negative) is refused.

        The priors: every HELDOUT_EVERY-th document is held out of a first table, and the
        first step's acceptance per bucket is measured on the held-out documents' tokens
        from `starts[i]` on (the answers; default: all); buckets seen PRIOR_MIN times keep
        their rate. The table kept is then built from every document."""
        docs = [np.asarray(d, np.int64) for d in docs]
        top = max((int(d.max()) for d in docs if len(d)), default=-1)
        if any(len(d) and int(d.min()) < 0 for d in docs):
            raise ValueError("token ids must not be negative")
        if vocab_size is not None and top >= vocab_size:
            raise ValueError(f"token id {top} is outside the vocabulary ({vocab_size})")
        ids = "u2" if (vocab_size if vocab_size is not None else top + 1) <= 0x10000 else "u4"
        starts = list(starts) if starts is not None else [1] * len(docs)
        priors: dict[str, float] = {}
        if len(docs) >= 2 * HELDOUT_EVERY:
            held = set(range(0, len(docs), HELDOUT_EVERY))
            first = cls(_tables([d for i, d in enumerate(docs) if i not in held], orders, ids), ids=ids)
            seen: dict[tuple, list[int]] = {}
            for i in sorted(held):
                d = docs[i].tolist()
                for j in range(max(1, starts[i]), len(d)):
                    r = first.next_token(d[max(0, j - max(orders)) : j])
                    if r is not None:
                        seen.setdefault(r[3], []).append(int(r[1] == d[j]))
            priors = {f"corpus:{b}": round(sum(v) / len(v), 3) for b, v in sorted(seen.items())
                      if len(v) >= PRIOR_MIN}
        return cls(_tables(docs, orders, ids), vocab_hash, priors, ids)

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
            i = int(np.searchsorted(keys, np.uint32(h)))  # (the keys' own dtype: no converted copy)
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
        """The file (see the module docstring); refuses values its dtypes cannot hold rather
        than wrapping them."""
        tables = list(self.tables.values())
        header = {"format": FORMAT, "vocab_hash": self.vocab_hash, "priors": self.priors, "orders": list(self.tables),
                  "sizes": [len(t[0]) for t in tables], "ids": self.ids}
        hj = json.dumps(header, sort_keys=True).encode()
        hj += b" " * (-(len(MAGIC) + 4 + len(hj)) % 8)  # the arrays start 8-byte aligned
        parts = [MAGIC, struct.pack("<I", len(hj)), hj]
        id_max = np.iinfo(ID_DTYPES[self.ids]).max
        for col, dt, hi, what in ((0, "<u4", 0xFFFFFFFF, "keys"), (1, "<" + self.ids, id_max, "token ids"),
                                  (2, "<u2", COUNT_MAX, "counts"), (3, "<u2", COUNT_MAX, "counts")):
            for n, t in zip(self.tables, tables, strict=True):
                a = np.asarray(t[col])
                if len(a) and (int(a.min()) < 0 or int(a.max()) > hi):
                    raise ValueError(f"order {n}: {what} outside 0..{hi} (the file's {dt[1:]})")
                parts.append(a.astype(dt).tobytes())
        body = b"".join(parts)
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes, vocab_hash: str | None = None, name: str = "corpus") -> CorpusTable:
        """Checked (see the module docstring); the arrays are read-only views of `data`."""
        if any(data.startswith(m) for m in OLD_MAGICS):
            raise CorpusError(f"{name}: an older corpus format ({data[:7].decode()}, 20 bytes a context); rebuild it "
                              f"(python -m edgespec.converters.distill.corpus, or edgespec distill)")
        if len(data) < len(MAGIC) + 8 or not data.startswith(MAGIC):
            raise CorpusError(f"{name}: not an edgespec corpus file")
        view = memoryview(data)
        body, crc = view[:-4], struct.unpack("<I", view[-4:])[0]
        if zlib.crc32(body) != crc:
            raise CorpusError(f"{name}: checksum mismatch (damaged or truncated)")
        (hl,) = struct.unpack_from("<I", body, len(MAGIC))
        off = len(MAGIC) + 4
        try:
            header = json.loads(bytes(body[off : off + hl]))
            orders, sizes = [int(n) for n in header["orders"]], [int(s) for s in header["sizes"]]
        except (ValueError, KeyError, TypeError) as e:
            raise CorpusError(f"{name}: unreadable header ({e})") from None
        ids = header.get("ids")
        if (header.get("format") != FORMAT or len(orders) != len(sizes) or any(n < 1 for n in orders)
                or any(s < 0 for s in sizes) or not isinstance(ids, str) or ids not in ID_DTYPES):
            raise CorpusError(f"{name}: unreadable header")
        if vocab_hash is not None and header.get("vocab_hash") not in (None, vocab_hash):
            raise CorpusError(f"{name}: built for another vocabulary ({header.get('vocab_hash')})")
        off += hl
        per = 4 + np.dtype(ID_DTYPES[ids]).itemsize + 2 + 2
        if off + per * sum(sizes) != len(body):
            raise CorpusError(f"{name}: sizes do not match the file")
        cols = []
        for dt in ("<u4", "<" + ids, "<u2", "<u2"):
            col = []
            for s in sizes:
                a = np.frombuffer(body, dt, s, off)  # a view (read-only: the bytes are)
                off += a.nbytes
                col.append(a)
            cols.append(col)
        tables = {}
        for i, n in enumerate(orders):
            keys, top, topc, total = (c[i] for c in cols)
            if len(keys) > 1 and not bool(np.all(keys[1:] > keys[:-1])):
                raise CorpusError(f"{name}: keys of order {n} are not sorted")
            if len(keys) and (topc.min() < 1 or bool(np.any(total < topc))):
                raise CorpusError(f"{name}: counts of order {n} out of range")
            tables[n] = (keys, top, topc, total)
        priors = header.get("priors") or {}
        if not isinstance(priors, dict) or not all(
                isinstance(k, str) and k.startswith("corpus:") and isinstance(v, (int, float)) and 0 <= v <= 1
                for k, v in priors.items()):
            raise CorpusError(f"{name}: unreadable priors")
        return cls(tables, header.get("vocab_hash"), priors, ids)

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
