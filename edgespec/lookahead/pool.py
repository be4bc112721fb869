"""The n-gram pool of lookahead decoding: where guesses for the next tokens come from.

Two stores, both keyed by the token the guess would follow:
- text: positions in the committed sequence (prompt + accepted output). A
  candidate is the `span` tokens that followed an earlier occurrence of the
  last token; occurrences whose preceding tokens also match the current
  context rank first (prompt lookup's longest-suffix rule), then the most recent.
- jacobi: (N-1)-token continuations read off the lookahead branch's Jacobi
  trajectories, most recent first.
Everything here is host-side Python: a step asks for a handful of candidates.
"""

from __future__ import annotations

import random
from collections import OrderedDict

CONTEXT_CHECK = 8  # preceding tokens compared when ranking text occurrences


class NgramPool:
    def __init__(self, span: int, jacobi_len: int, per_key: int = 64, jacobi_per_key: int = 8):
        if span < 1 or jacobi_len < 1:
            raise ValueError("n-gram continuations need at least one token")
        self.span = span
        self.jacobi_len = jacobi_len
        self.per_key = per_key
        self.jacobi_per_key = jacobi_per_key
        self.text: dict[int, list[int]] = {}  # token -> positions where it occurs (ascending)
        self.jacobi: dict[int, OrderedDict] = {}  # token -> {continuation tuple: None}, newest last
        self._indexed = 0  # positions < _indexed are in `text`

    def add_text(self, seq: list[int]) -> None:
        """Index the committed positions not seen yet (every position but the last one)."""
        for i in range(self._indexed, len(seq) - 1):
            occ = self.text.setdefault(seq[i], [])
            occ.append(i)
            if len(occ) > 2 * self.per_key:
                del occ[: len(occ) - self.per_key]
        self._indexed = max(self._indexed, len(seq) - 1)

    def add_jacobi(self, key: int, continuation: list[int]) -> None:
        d = self.jacobi.setdefault(key, OrderedDict())
        t = tuple(continuation[: self.jacobi_len])
        d.pop(t, None)
        d[t] = None
        if len(d) > self.jacobi_per_key:
            d.popitem(last=False)

    def text_candidates(self, seq: list[int], limit: int) -> list[list[int]]:
        """Up to `limit` distinct continuations of seq[-1] copied from the sequence."""
        return [cont for _, cont in self.text_matches(seq, limit)]

    def text_matches(self, seq: list[int], limit: int) -> list[tuple[int, list[int]]]:
        """Like text_candidates, with each continuation's matching context length (0..CONTEXT_CHECK):
        how many tokens before seq[-1] also match before the copied occurrence."""
        occ = self.text.get(seq[-1])
        if not occ or limit <= 0:
            return []
        end = len(seq) - 1
        scored = []
        for i in occ[-self.per_key :]:
            if i >= end:
                continue
            k = 0
            while k < CONTEXT_CHECK and i - 1 - k >= 0 and seq[i - 1 - k] == seq[end - 1 - k]:
                k += 1
            scored.append((k, i))
        scored.sort(reverse=True)  # longest matching context, then most recent
        out, seen = [], set()
        for k, i in scored:
            cont = tuple(seq[i + 1 : i + 1 + self.span])
            if cont and cont not in seen:
                seen.add(cont)
                out.append((k, list(cont)))
                if len(out) == limit:
                    break
        return out

    def jacobi_candidates(self, key: int, limit: int) -> list[list[int]]:
        d = self.jacobi.get(key)
        if not d or limit <= 0:
            return []
        return [list(t) for t in reversed(d)][:limit]

    def candidates(self, seq: list[int], guesses: int) -> list[list[int]]:
        """Up to `guesses` continuations of seq[-1]: about half from text, the rest Jacobi.

        Only the best-ranked text candidate keeps the full `span`; the others are cut
        to N-1 tokens, since every fed token costs verifier time and runner-up copies
        rarely survive far.
        """
        text = self.text_candidates(seq, guesses)
        text = text[:1] + [c[: self.jacobi_len] for c in text[1:]]
        jac = self.jacobi_candidates(seq[-1], guesses)
        n_text = min(len(text), max(guesses - len(jac), (guesses + 1) // 2))
        out = text[:n_text] + jac[: guesses - n_text]
        return out + text[n_text : n_text + guesses - len(out)]


class JacobiWindow:
    """Lookahead's W x (N-1) window of guesses; each verified pass advances it one Jacobi level.

    `levels[j][i]` is column i's guess at level j (level 0 continues x0). After a pass,
    `advance(pool, top)` takes the verifier's predictions `top` at the top level's nodes,
    stores every column's N-gram (its guesses plus the prediction) in the pool keyed by
    the column's first token, and shifts the levels up.
    """

    def __init__(self, window: int, ngram: int, prompt: list[int]):
        if window < 1 or ngram < 2:
            raise ValueError("a Jacobi window needs window >= 1 and ngram >= 2")
        self.W, self.N = window, ngram
        # Any guesses do (verification keeps the output exact); prompt tokens converge
        # faster than random ids. Seeded, so runs are reproducible.
        rng = random.Random(len(prompt))
        self.levels = [[rng.choice(prompt) for _ in range(window)] for _ in range(ngram - 1)]

    def advance(self, pool: NgramPool, top: list[int]) -> None:
        for i in range(self.W):
            column = [lv[i] for lv in self.levels] + [int(top[i])]
            pool.add_jacobi(column[0], column[1:])
        self.levels = self.levels[1:] + [[int(t) for t in top]]
