"""Build long.jsonl: long-prompt traffic (1-4k tokens) from the documents of mixed.jsonl.

retrieval: "Answer the question using only the documents below" + 3, 5 or all 12 of mixed.jsonl's
rag documents and articles, the question of one rag document (its place in the pile varies);
summarization: 4 or 6 of its articles, then "Summarize each text" or "Summarize text k".
Deterministic: `python benchmarks/prompts/make_long.py` rewrites the same file.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    rag, articles = [], []
    for line in (HERE / "mixed.jsonl").read_text(encoding="utf-8").splitlines():
        d = json.loads(line)
        if d["domain"] == "rag":
            doc, question = d["prompt"].split("\n\nDocument: ", 1)[1].rsplit("\n\nQuestion: ", 1)
            rag.append((doc, question))
        elif d["domain"] == "summarization":
            articles.append(d["prompt"].rsplit("\n\n", 1)[0])
    docs = [d for d, _ in rag] + articles
    out = []
    # retrieval: the question's document first, in the middle or last, among n documents
    for i, (n, target) in enumerate([(3, 0), (5, 2), (12, 4), (5, 5), (12, 1), (8, 3)]):
        doc, question = rag[target % len(rag)]
        others = [d for d in docs if d != doc][: n - 1]
        at = [0, len(others) // 2, len(others)][i % 3]
        pile = others[:at] + [doc] + others[at:]
        body = "\n\n".join(f"Document {j + 1}:\n{d}" for j, d in enumerate(pile))
        out.append({"id": f"long-retrieval-{i + 1}", "domain": "retrieval", "prompt":
                    "Answer the question using only the documents below. If the answer is not in them, "
                    f"say so.\n\n{body}\n\nQuestion: {question}"})
    for i, n in enumerate([4, 6, 6, 4, 6, 6]):
        pick = [articles[(i + j) % len(articles)] for j in range(n)]
        body = "\n\n".join(f"Text {j + 1}:\n{d}" for j, d in enumerate(pick))
        ask = ("Summarize each text above in one sentence." if i % 2 == 0
               else f"Summarize text {n // 2 + 1} above in 2-3 sentences.")
        out.append({"id": f"long-summarization-{i + 1}", "domain": "summarization", "prompt": f"{body}\n\n{ask}"})
    # interleave the domains (a run cut short still covers both)
    ret, summ = out[:6], out[6:]
    lines = [json.dumps(x, ensure_ascii=False) for pair in zip(ret, summ, strict=True) for x in pair]
    (HERE / "long.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
