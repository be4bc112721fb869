"""Mode "plain": autoregressive decoding with the verifier alone, the reference every mode equals."""

from edgespec.generate import PlainMode
from edgespec.modes.registry import register_mode


@register_mode("plain", "autoregressive decoding with the verifier alone (the reference)")
def make_plain(engine, options):
    return PlainMode(engine.model)
