"""Data files shipped with edgespec: built-in prompt sets, calibration answers, shipped drafters
and the hub drafter catalog (read by path or importlib.resources; no code here)."""
