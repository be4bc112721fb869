"""Prompt lookup: a weight-free drafter that copies n-grams from the context.

If the last n tokens (n = ngram_max down to ngram_min) occurred earlier in the
committed sequence (prompt + output), the tokens that followed their most
recent occurrence are proposed. Summaries, edits and code refactors repeat
long spans of their input, so whole spans are accepted at once. Proposals are
deterministic (Draft.logprobs None: a point mass), so verification stays lossless
under sampling too (see edgespec.logits.rejection).
"""

from __future__ import annotations

from edgespec.drafters.base import Draft, DrafterCaps, common_prefix


class PromptLookupDrafter:
    name = "prompt_lookup"
    device = "none"  # no model: a few dictionary look-ups on the host
    vocab_size = 0  # works with any vocabulary
    expected_acceptance = 0.5
    caps = DrafterCaps(runs_on="host")
    host_bytes = 0  # no weights
    model = None  # no weights

    def __init__(self, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max <= 16:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max <= 16, got {ngram_min}, {ngram_max}"
            )
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.seq: list[int] = []
        self._last: dict[tuple[int, ...], int] = {}  # n-gram -> latest index of its last token
        self._indexed = 0  # n-grams ending before this index are in _last
        self._last_draft: list[int] = []

    def begin(self, prompt: list[int]) -> None:
        if not prompt:
            raise ValueError("the drafter needs a non-empty prompt")
        self.seq = [int(t) for t in prompt]
        self._last = {}
        self._indexed = 0
        self._last_draft = []

    def _index(self) -> None:
        # Index n-grams ending at every position but the last: the last one's
        # n-grams are the query and must find an *earlier* occurrence.
        seq = self.seq
        for j in range(self._indexed, len(seq) - 1):
            for n in range(self.ngram_min, min(self.ngram_max, j + 1) + 1):
                self._last[tuple(seq[j - n + 1 : j + 1])] = j
        self._indexed = max(self._indexed, len(seq) - 1)

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        self._index()
        seq = self.seq
        for n in range(min(self.ngram_max, len(seq)), self.ngram_min - 1, -1):
            j = self._last.get(tuple(seq[-n:]))
            if j is not None:
                return seq[j + 1 : j + 1 + k]
        return []

    def draft(self, k: int, sampler=None) -> Draft:
        self._last_draft = self.lookup(k) if k > 0 else []
        return Draft(list(self._last_draft), None)

    def accept(self, n_accepted: int, next_token: int) -> None:
        if not 0 <= n_accepted <= len(self._last_draft):
            raise ValueError(f"n_accepted must be in 0..{len(self._last_draft)}, got {n_accepted}")
        self.seq.extend(self._last_draft[:n_accepted] + [int(next_token)])
        self._last_draft = []

    def sync(self, committed: list[int]) -> None:
        """Make `committed` the committed sequence (re-indexing only if history changed)."""
        keep = common_prefix(self.seq, committed)
        if keep < len(self.seq):
            self.begin(list(committed))
        else:
            self.seq = [int(t) for t in committed]
        self._last_draft = []

    def close(self) -> None:
        self.seq, self._last = [], {}
