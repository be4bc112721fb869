"""Models by their Hugging Face hub name (ORG/NAME[@REVISION][:QUANT]): fetched with huggingface_hub
into its shared cache, resolved offline when already there, paired with a drafter from the catalog
edgespec/data/hub_drafters.json, listed and removed (edgespec.hub.manage). See docs/hub.md."""

from edgespec.hub.names import HubName, as_hub_name, parse

__all__ = ["HubName", "as_hub_name", "parse"]
