"""MODEL_CARD.md for a distilled drafter: data, size, acceptance by domain, cost, recipe."""

from __future__ import annotations

from typing import Any

from mlx.utils import tree_flatten


def _table(acc: dict[str, dict[str, float]]) -> str:
    rows = ["| domain | accepted / drafted | rate | tokens per verifier pass |", "| --- | --- | --- | --- |"]
    for d in sorted(acc, key=lambda d: (d == "all", d)):
        a = acc[d]
        rows.append(f"| {d} | {a['accepted']} / {a['drafted']} | {a['rate']:.3f} | {a['tokens_per_round']:.2f} |")
    return "\n".join(rows)


def _cost_text(info: dict[str, Any]) -> str:
    cost = info.get("cost")
    if not cost:
        return "Not measured."
    return (
        f"One draft step takes {cost['draft_step_s'] * 1e3:.2f} ms; one verifier decode step "
        f"{cost['verifier_step_s'] * 1e3:.2f} ms and one verify pass of K+1={info['k'] + 1} tokens "
        f"{cost['verify_pass_s'] * 1e3:.2f} ms, measured interleaved on {info.get('machine', 'this machine')} "
        f"at a {info.get('cost_context', '?')}-token context. **Draft step / verifier step = "
        f"{cost['ratio_step']:.1%}** (/ verify pass = {cost['ratio_pass']:.1%})."
    )


def model_card(info: dict[str, Any]) -> str:
    """Markdown from the facts `edgespec distill` gathered (keys used below)."""
    cost_txt = _cost_text(info)
    acc = info.get("acceptance")
    n_seq = info.get("n_sequences", info["n_prompts"])
    answers = (
        f"The verifier answered each greedily and {info['samples'] - 1} more time(s) sampling at temperature "
        f"{info['sample_temperature']} (near-greedy branches; prompts of --add-data files once; {n_seq} sequences, "
        f"up to {info['max_new']} new tokens)"
        if info.get("samples", 1) > 1
        else f"The verifier answered each greedily (up to {info['max_new']} new tokens)"
    )
    return f"""# Distilled drafter for {info['verifier_name']}

A small Llama-family drafter trained by `edgespec distill` to imitate its verifier
for lossless speculative decoding. It shares the verifier's tokenizer (vocab hash
`{info['vocab_hash']}`) but predicts only a reduced output vocabulary of
{info['vocab_n']} slots (`vocab_map.json`: slot 0 = "any other token", slots 1.. =
full token ids). `edgespec.drafters.distilled.DistilledDrafter` maps inputs to the
reduced ids and expands q to the full vocabulary with q = 0 outside the kept set,
which keeps rejection sampling exact (the verifier's residual covers those tokens).

## Architecture and size
- {info['layers']} decoder layer(s), hidden {info['hidden']}, {info['heads']} heads / {info['kv_heads']} KV heads,
  MLP {info['intermediate']}, tied embedding/head over {info['vocab_n']} tokens; {info['params'] / 1e6:.2f} M parameters.
- Weights fp16: {info['size_mb']:.1f} MB on disk. Initialised from the verifier: embedding rows
  of the kept tokens, layers {info['init_layers']}, final norm.
- Size choice: {info.get('size_reason', '')}

## Training data
- Prompts: {info['n_prompts']} (sequences per domain: {info['domains']}) from `{info['prompts']}`.
- {answers}; at each generated
  position its top-{info['topk']} log-probabilities were recorded: {info['n_targets']} target positions.
- Reduced vocabulary coverage of the verifier's greedy tokens: {info['coverage_train']:.1%} (training data),
  {info.get('coverage_heldout', float('nan')):.1%} (held-out).

## Training
KL to the verifier's top-{info['topk']} distribution (renormalised), AdamW, lr {info['lr']} (warmup
{info['warmup']}, cosine to 10%), {info['steps']} steps of {info['batch_size']} sequences,
seed {info['seed']}; final loss {info.get('final_loss', float('nan')):.3f}. Wall time {info.get('train_minutes', float('nan')):.0f} min
(data {info.get('data_minutes', float('nan')):.0f} min) on {info.get('machine', 'this machine')}.

## Held-out acceptance (greedy, K={info['k']}, accepted / drafted)
Prompts not used in training (`{info.get('heldout', '')}`); simulated exactly on the verifier's
greedy continuations.

{_table(acc) if acc else 'Not measured.'}

## Cost
{cost_txt}

## Limitations
{info.get('limitations', '')}

## Recipe
```
{info['recipe']}
```
"""


def feature_card(info: dict[str, Any]) -> str:
    """MODEL_CARD.md of a feature drafter (`edgespec distill --kind feature`)."""
    cost_txt = _cost_text(info)
    acc = info.get("acceptance")
    return f"""# Feature drafter for {info['verifier_name']}

An EAGLE-style drafter trained by `edgespec distill --kind feature`: {info['layers']} decoder
layer(s) that read the verifier's own last hidden state (after its final norm) and the
next token's embedding, and guess the verifier's next hidden state; the verifier's LM
head, restricted to {info['vocab_n'] - 1} kept token ids (`vocab_map.json`), turns each
guess into q. It drafts only in mode `speculative`, which hands it the verifier's
features of every committed token. Token embedding and head are the verifier's, read at
load time: the folder holds neither. q = 0 outside the kept ids keeps rejection sampling
exact. Tokenizer vocab hash `{info['vocab_hash']}`.

## Architecture and size
- fc (2 x {info['hidden']} -> {info['hidden']}), {info['layers']} decoder layer(s) ({info['heads']} heads /
  {info['kv_heads']} KV heads, MLP {info['intermediate']}), output RMSNorm; {info['params'] / 1e6:.2f} M parameters.
- Weights fp16: {info['size_mb']:.1f} MB on disk.

## Training data
- Prompts: {info['n_prompts']} (sequences per domain: {info['domains']}) from `{info['prompts']}`;
  the verifier's answers (up to {info['max_new']} new tokens{', ' + str(info['samples']) + ' answers per prompt' if info.get('samples', 1) > 1 else ''}).
- The verifier's features at every position, teacher-forced ({info.get('feature_minutes', float('nan')):.0f} min):
  {info['n_positions']} training positions, prompts included (targets come from the features).
- Kept-vocabulary coverage of the verifier's greedy tokens: {info['coverage_train']:.1%} (training data),
  {info.get('coverage_heldout', float('nan')):.1%} (held-out).

## Training
Cross-entropy to the verifier's distribution over the kept ids plus {info['reg_weight']} x smooth-L1 to
its next feature, averaged over {info['unroll']} unrolled draft steps (step s reads the guesses of
step s-1, with the attention mask an incremental draft has). AdamW, lr {info['lr']} (warmup
{info['warmup']}, cosine to 10%), {info['steps']} steps of {info['batch_size']} sequences (up to {info['max_len']} tokens),
seed {info['seed']}; final loss {info.get('final_loss', float('nan')):.3f}. Wall time {info.get('train_minutes', float('nan')):.0f} min
on {info.get('machine', 'this machine')}.

## Held-out acceptance (greedy, K={info['k']}, accepted / drafted)
Prompts not used in training (`{info.get('heldout', '')}`), run through the runtime
`FeatureDrafter` on the verifier's greedy continuations and their features.

{_table(acc) if acc else 'Not measured.'}

## Cost
{cost_txt}

## Limitations
{info.get('limitations', '')}

## Recipe
```
{info['recipe']}
```
"""


def _params(model) -> int:
    """Parameters of an MLX model (the card's size)."""
    return sum(v.size for _, v in tree_flatten(model.parameters()))


def _count(xs) -> dict[str, int]:
    """How often each value occurs (the card's examples per domain)."""
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return out
