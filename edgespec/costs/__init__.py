"""Costs as a model, not a timer: Apple-silicon profiles (profiles.py), a roofline cost model
calibrated to published figures (model.py), the one interface the planner prices with and the
simulated clock that runs a decoder on a profile's time (clock.py)."""
