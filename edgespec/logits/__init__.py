"""Logits to tokens: what turns the verifier's logits into the distribution every mode draws from.

    sampling.py    sampling settings, logits -> log-probabilities, the seeded draw
    processors.py  the one logits-processing step (penalties, grammar mask, logprobs)
    rejection.py   speculative sampling's accept/resample rule
    exactness.py   the runtime exactness guard (EDGESPEC_CHECK_EXACT=1)
    structured/    structured output: JSON schemas, regexes, grammars compiled to token masks
    tools.py       tool calls: the tool list rendered by the chat template, calls parsed back

Import the module you need; nothing is re-exported here (edgespec's public names such as
SamplingParams are re-exported by edgespec/__init__.py).
"""
