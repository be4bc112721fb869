"""Caches: what a model keeps between passes, and what edgespec keeps of it between requests.

    kv.py        the per-layer state protocol and the KV cache with cheap rollback
    kv_quant.py  the KV cache stored quantized (`--kv-bits 8|4`)
    recurrent.py recurrent layers' state caches (short convolutions, gated delta rule)
    prefix.py    prefix reuse: earlier prompts' and replies' caches kept for later requests
    sessions.py  saved caches on disk: chat sessions and prefilled prompts

Import the module you need (`from edgespec.caches.kv import KVCache`); nothing is re-exported
here, so importing one cache module never loads the others.
"""
