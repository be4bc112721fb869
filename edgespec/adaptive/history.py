"""A suffix index over this engine's earlier prompts and replies: drafts from past traffic.

Tool calls, JSON extraction and templated answers repeat what earlier replies
said. `HistoryStore` keeps finished generations (prompt ids + reply ids) as
documents in one token array and indexes the n-grams ending at every position
(n in NGRAMS); a lookup finds the longest n-gram that ends the current
context and proposes what followed its most recent occurrences, most frequent
continuation first (SuffixDecoding's idea, with a hashed n-gram index instead
of a suffix tree). History only shapes drafts: every proposal is verified.

Bounds and privacy:
- memory: tokens and index entries are counted (`nbytes`, an estimate of
  CPython's sizes); past `max_bytes` the oldest documents are dropped and the
  index rebuilt.
- thread-safe: one lock around every read and write.
- where it lives: in memory only by default (`mode="memory"`); with
  `mode="disk"` the documents also go to `<EDGESPEC_HOME>/history/<key>.bin`
  (key = the tokenizer's identity), rewritten atomically after each document,
  capped at `max_bytes`, and loaded on start. `mode="off"` keeps nothing.

The file on disk (replace only what edgespec wrote, edgespec.safe_write):
- format: MAGIC2, document count, each document's length and ids, then a CRC-32
  of all that (the older MAGIC files, without the CRC, are still read);
- written to a temp file beside it (`.<name>.tmp-<pid>-...`, mode 0600: it is a
  chat log) and renamed over it, so a reader or a process killed mid-save sees
  the old file or the new one, whole. Two processes saving the same file leave
  the one that renamed last, complete (no lock: the rename is atomic); a killed
  writer's temp is removed by the next save;
- a file at the path that does not read as edgespec history (truncated, bit
  flipped, another format) is never overwritten or deleted: at load it is renamed
  to `<name>.corrupt` (`.corrupt-1`, ... if taken) with a warning and history
  starts empty; one that appears there later is left alone and this store stops
  saving (warning); `clear()` removes only an edgespec history file;
- a save that fails (full disk, no permission) logs a warning and leaves the old
  file: history is only a hint, and the reply that triggered it is unaffected.
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import threading
import zlib
from array import array
from collections import Counter
from pathlib import Path

from edgespec.paths import home
from edgespec.safe_write import aside_name, clean_stale_temps, temp_prefix

log = logging.getLogger("edgespec.history")

NGRAMS = (2, 3, 4, 6, 8, 12)  # suffix lengths indexed (longest match wins)
PER_KEY = 4  # most recent occurrences kept per n-gram
SEP = -1  # between documents: no continuation crosses it
# CPython sizes, measured with sys.getsizeof: a dict slot with an int key and a small
# list value, and 4 bytes per stored token (array('i')).
ENTRY_BYTES = 160
POS_BYTES = 36
MAGIC = b"ESHIST1\n"  # read only: no checksum
MAGIC2 = b"ESHIST2\n"  # written: ... + CRC-32 of everything before it
MODES = ("memory", "disk", "off")


class HistoryStore:
    def __init__(self, max_bytes: int = 64 << 20, path: str | Path | None = None, max_doc_tokens: int = 16384):
        if max_bytes < 1 << 16:
            raise ValueError(f"history max_bytes must be at least 64 KiB, got {max_bytes}")
        self.max_bytes = int(max_bytes)
        self.max_doc_tokens = max_doc_tokens
        self.path = Path(path) if path is not None else None
        self._lock = threading.Lock()
        self._tokens = array("i")
        self._docs: list[int] = []  # start offset of each document in _tokens
        self._index: dict[int, list[int]] = {}  # hash(n-gram) -> positions just after it (newest last)
        self._positions = 0
        self.lookups = 0
        self.hits = 0
        self._saving = self.path is not None  # False once the path holds a file edgespec did not write
        self._warned: set[str] = set()
        if self.path is not None and os.path.lexists(self.path):
            self._load()

    # ------------------------------------------------------------------ size
    @property
    def nbytes(self) -> int:
        return 4 * len(self._tokens) + ENTRY_BYTES * len(self._index) + POS_BYTES * self._positions

    @property
    def documents(self) -> int:
        return len(self._docs)

    def __len__(self) -> int:
        return len(self._tokens) - len(self._docs)

    # ------------------------------------------------------------------ writing
    def add(self, tokens: list[int]) -> None:
        """Remember one finished generation (prompt + reply ids)."""
        toks = [int(t) for t in tokens][-self.max_doc_tokens :]
        if len(toks) < 2 or any(t < 0 for t in toks):
            return
        with self._lock:
            self._append(toks)
            if self.nbytes > self.max_bytes:
                self._evict()
            if self.path is not None:
                self._save()

    def _append(self, toks: list[int]) -> None:
        start = len(self._tokens)
        self._docs.append(start)
        self._tokens.extend(toks)
        self._tokens.append(SEP)
        self._index_range(start, start + len(toks))

    def _index_range(self, start: int, end: int) -> None:
        t = self._tokens
        index = self._index
        for j in range(start + 1, end):  # an n-gram ending at j-1, followed by t[j]
            for n in NGRAMS:
                if j - n < start:
                    break
                key = hash(tuple(t[j - n : j]))
                occ = index.get(key)
                if occ is None:
                    index[key] = [j]
                    self._positions += 1
                else:
                    occ.append(j)
                    if len(occ) > PER_KEY:
                        del occ[0]
                    else:
                        self._positions += 1

    def _evict(self) -> None:
        """Drop the oldest documents until at most half the budget is used, then re-index."""
        docs = list(zip(self._docs, self._docs[1:] + [len(self._tokens)], strict=True))
        keep: list[tuple[int, int]] = []
        budget = self.max_bytes // 2
        used = 0
        for s, e in reversed(docs):
            # each token costs its 4 bytes plus up to len(NGRAMS) index entries
            cost = (e - s) * (4 + len(NGRAMS) * (ENTRY_BYTES + POS_BYTES) // 2)
            if used + cost > budget and keep:
                break
            keep.append((s, e))
            used += cost
        old = self._tokens
        self._tokens, self._docs, self._index, self._positions = array("i"), [], {}, 0
        for s, e in reversed(keep):
            self._append(list(old[s : e - 1]))

    def clear(self) -> None:
        with self._lock:
            self._tokens, self._docs, self._index, self._positions = array("i"), [], {}, 0
            if self.path is not None and os.path.lexists(self.path):
                if is_history_file(self.path):
                    self.path.unlink()
                else:
                    self._warn_foreign()

    # ------------------------------------------------------------------ reading
    def lookup(self, context: list[int], limit: int = 2, span: int = 16) -> list[tuple[int, list[int]]]:
        """Up to `limit` (match length, continuation) pairs for the end of `context`.

        The longest indexed n-gram ending `context` that occurred before decides;
        its occurrences' continuations (up to `span` tokens, never past a document's
        end) are ranked by how many occurrences agree on their first tokens, then recency.
        """
        if limit <= 0 or span <= 0:
            return []
        with self._lock:
            self.lookups += 1
            t = self._tokens
            for n in reversed(NGRAMS):
                if len(context) < n:
                    continue
                gram = [int(x) for x in context[-n:]]
                occ = self._index.get(hash(tuple(gram)))
                if not occ:
                    continue
                conts = []
                for j in reversed(occ):
                    if list(t[j - n : j]) != gram:
                        continue  # hash collision
                    c = []
                    for x in t[j : j + span]:
                        if x == SEP:
                            break
                        c.append(x)
                    if c:
                        conts.append(c)
                if not conts:
                    continue
                self.hits += 1
                heads = Counter(tuple(c[:4]) for c in conts)
                ranked = sorted(range(len(conts)), key=lambda i: (-heads[tuple(conts[i][:4])], i))
                out, seen = [], set()
                for i in ranked:
                    key = tuple(conts[i])
                    if key not in seen:
                        seen.add(key)
                        out.append((n, conts[i]))
                        if len(out) == limit:
                            break
                return out
        return []

    # ------------------------------------------------------------------ disk
    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:  # once per kind of trouble per store, not after every reply
            self._warned.add(key)
            log.warning("%s", message)

    def _warn_foreign(self) -> None:
        self._warn("foreign", f"history file {self.path} is not an edgespec history file (another program "
                   "wrote it); leaving it as it is, and keeping this history in memory only")

    def _save(self) -> None:
        """Atomically rewrite the file: MAGIC2, document count, each document's length and ids, CRC-32.

        Never over a file edgespec did not write; a failure (full disk, no permission) is a
        warning: the file stays as it was and the history in memory."""
        assert self.path is not None
        if not self._saving:
            return
        if os.path.lexists(self.path) and not is_history_file(self.path):
            self._saving = False
            self._warn_foreign()
            return

        bounds = list(zip(self._docs, self._docs[1:] + [len(self._tokens)], strict=True))
        parts = [MAGIC2, struct.pack("<I", len(bounds))]
        for s, e in bounds:
            doc = self._tokens[s : e - 1]
            parts += [struct.pack("<I", len(doc)), doc.tobytes()]
        body = b"".join(parts)
        body += struct.pack("<I", zlib.crc32(body))
        tmp = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            clean_stale_temps(self.path)  # of writers killed mid-save
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f"{temp_prefix(self.path)}{os.getpid()}-")
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, self.path)
        except OSError as e:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            self._warn(f"save-{e.errno}", f"could not save history to {self.path} ({e}); the file is as it was, "
                       "and this history is kept in memory")  # fmt: skip
        except BaseException:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
            raise

    def _load(self) -> None:
        """Read the file written by `_save`. A file that does not read as edgespec history is renamed
        to <name>.corrupt (never lost, never overwritten) and history starts empty: it is only a hint."""
        try:
            docs = read_history_file(self.path)
        except OSError as e:  # unreadable (permissions, a folder): leave it, do not save over it
            self._saving = False
            self._warn("load", f"could not read history file {self.path} ({e}); leaving it as it is, and keeping "
                       "this history in memory only")  # fmt: skip
            return
        except ValueError as e:
            aside = aside_name(self.path)
            try:
                os.replace(self.path, aside)
            except OSError as err:
                self._saving = False
                self._warn("load", f"history file {self.path} is damaged ({e}) and could not be moved aside "
                           f"({err}); leaving it as it is, and keeping this history in memory only")  # fmt: skip
                return
            self._warn("load", f"history file {self.path} is damaged ({e}); kept it as {aside.name} and "
                       "started an empty history")  # fmt: skip
            return
        for d in docs:
            if len(d) >= 2 and min(d) >= 0:
                self._append(d)
        if self.nbytes > self.max_bytes:
            self._evict()


def is_history_file(path: Path) -> bool:
    """Whether `path` is a regular file that starts like an edgespec history file."""
    try:
        if not Path(path).is_file() or Path(path).is_symlink():
            return False
        with open(path, "rb") as f:
            return f.read(len(MAGIC2)) in (MAGIC, MAGIC2)
    except OSError:
        return False


def read_history_file(path: Path) -> list[list[int]]:
    """The documents of a history file; ValueError naming what is wrong when it is not one, whole."""
    path = Path(path)
    if path.is_symlink() or not path.is_file():
        raise OSError(f"{path} is not a regular file")
    data = path.read_bytes()
    if data.startswith(MAGIC2):
        if len(data) < len(MAGIC2) + 8:
            raise ValueError("truncated")
        body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
        if zlib.crc32(body) != crc:
            raise ValueError("checksum mismatch: truncated or modified")
    elif data.startswith(MAGIC):
        body = data
    else:
        raise ValueError("not an edgespec history file")
    try:
        pos = len(MAGIC)
        (count,) = struct.unpack_from("<I", body, pos)
        pos += 4
        docs = []
        for _ in range(count):
            (n,) = struct.unpack_from("<I", body, pos)
            pos += 4
            a = array("i")
            a.frombytes(body[pos : pos + 4 * n])
            if len(a) != n:
                raise ValueError("truncated")
            pos += 4 * n
            docs.append(list(a))
    except struct.error:
        raise ValueError("truncated") from None
    if pos != len(body):
        raise ValueError(f"{len(body) - pos} unexpected bytes after the last document")
    return docs


def history_mode(value: str | None = None) -> str:
    """The history setting: the argument, else $EDGESPEC_HISTORY, else 'memory'; validated."""
    mode = value if value is not None else os.environ.get("EDGESPEC_HISTORY", "memory")
    mode = str(mode).strip().lower()
    if mode not in MODES:
        raise ValueError(f"history must be one of {', '.join(MODES)}, got {value!r}")
    return mode


def make_history(mode: str | None, key: str, max_bytes: int = 64 << 20) -> HistoryStore | None:
    """A store for this setting ('memory', 'disk' under $EDGESPEC_HOME/history, 'off' -> None)."""
    mode = history_mode(mode)
    if mode == "off":
        return None
    path = None
    if mode == "disk":
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in key)[:96] or "model"
        path = home() / "history" / f"{safe}.bin"
    return HistoryStore(max_bytes=max_bytes, path=path)
