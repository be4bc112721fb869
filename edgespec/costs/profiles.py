"""Apple-silicon chip classes as numbers a cost model can use, each with where it comes from.

One `Profile` per chip class (the largest GPU of the class where Apple sells several): unified
memory bandwidth, GPU cores and FP16 throughput, Neural Engine throughput, and the overheads a
roofline leaves out (a Metal kernel launch, a Neural Engine call with its transfers). Every number
carries its source in `SOURCES`: an Apple announcement (`apple-*`), a figure derived from one
(`derived:` says how), or a guess (`guess:` says what it stands for). Guesses are the constants the
calibration (edgespec.costs.model.CALIBRATION) checks as a whole; none of them was measured here.

FP16 on Apple GPUs runs at the FP32 rate (no double-rate half since M1), so `gpu_tflops` is the
FP32 figure Apple quotes, or cores x 128 lanes x 2 flops x clock where Apple quotes none.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Profile:
    name: str
    title: str
    bandwidth_gbs: float  # unified memory bandwidth, GB/s (10^9 bytes)
    gpu_cores: int
    gpu_tflops: float  # FP16 = FP32 rate, 10^12 flop/s
    ane_tops: float  # Neural Engine, 10^12 op/s as Apple quotes it
    sources: tuple[str, ...]  # keys of SOURCES behind the numbers above
    launch_us: float = 5.0  # one Metal kernel dispatch inside a command buffer (guess:launch)
    ane_call_us: float = 250.0  # one Core ML prediction: call and IOSurface transfers (guess:ane-call)
    cpu_bandwidth_gbs: float | None = None  # what the CPU cluster alone can stream (None: half the SoC's)

    @property
    def cpu_bw(self) -> float:
        """Bytes/s the CPU cores alone read (guess:cpu-bw: half the SoC bandwidth, at most 200 GB/s)."""
        return 1e9 * (self.cpu_bandwidth_gbs or min(0.5 * self.bandwidth_gbs, 200.0))


SOURCES: dict[str, str] = {
    "apple-m1": "Apple newsroom, 'Apple unleashes M1' (2020-11-10): 8-core GPU 2.6 TFLOPS, 16-core "
                "Neural Engine 11 TOPS; LPDDR4X-4266 on a 128-bit bus = 68.25 GB/s",
    "apple-m1-pro-max": "Apple newsroom, 'Introducing M1 Pro and M1 Max' (2021-10-18): 200 / 400 GB/s, "
                        "16-core GPU 5.2 TFLOPS / 32-core GPU 10.4 TFLOPS, Neural Engine 11 TOPS",
    "apple-m1-ultra": "Apple newsroom, 'Apple unveils M1 Ultra' (2022-03-08): 800 GB/s, 64-core GPU "
                      "21 TFLOPS, 32-core Neural Engine 22 TOPS",
    "apple-m2": "Apple newsroom, 'Apple unveils M2' (2022-06-06): 100 GB/s, 10-core GPU 3.6 TFLOPS, "
                "Neural Engine 15.8 TOPS",
    "apple-m2-pro-max": "Apple newsroom, 'Apple unveils M2 Pro and M2 Max' (2023-01-17): 200 / 400 GB/s, "
                        "19-core GPU 6.8 TFLOPS / 38-core GPU 13.6 TFLOPS, Neural Engine 15.8 TOPS",
    "apple-m2-ultra": "Apple newsroom, 'Apple introduces M2 Ultra' (2023-06-05): 800 GB/s, 76-core GPU "
                      "27.2 TFLOPS, 32-core Neural Engine 31.6 TOPS",
    "apple-m3": "Apple newsroom, 'Apple unveils M3, M3 Pro, and M3 Max' (2023-10-30): 100 / 150 / 400 GB/s "
                "(M3 Max with the 40-core GPU), GPUs of 10 / 18 / 40 cores, Neural Engine 18 TOPS",
    "apple-m4": "Apple newsroom, 'Apple introduces M4 chip' (2024-05-07): 120 GB/s, 10-core GPU, Neural "
                "Engine 38 TOPS",
    "apple-m4-pro-max": "Apple newsroom, 'Apple introduces M4 Pro and M4 Max' (2024-10-30): 273 / 546 GB/s, "
                        "20-core / 40-core GPU, Neural Engine 38 TOPS",
    "apple-m5": "Apple newsroom, 'Apple unleashes M5' (2025-10-15): 153 GB/s, 10-core GPU with a neural "
                "accelerator in each core ('over 4x the peak GPU compute for AI' of M4), 16-core Neural Engine",
    "derived:tflops": "derived: GPU cores x 128 FP32 lanes x 2 flops x a clock of 1.4 GHz (M3) / 1.5 GHz (M4) "
                      "where Apple quotes no TFLOPS; the clock is a guess from public reviews",
    "derived:m5-tflops": "derived: 4x the M4 figure for matrix products (Apple's 'over 4x peak GPU compute "
                         "for AI'); element-wise work does not get it",
    "guess:m5-ane": "guess: Apple gives no M5 Neural Engine TOPS; M4's 38 is used",
    "guess:launch": "guess: 5 us per Metal kernel dispatch encoded in one command buffer; with 14 kernels "
                    "a layer (edgespec.costs.model.KERNELS_PER_LAYER) it sets the floor of a small model's "
                    "step; checked only through the calibration as a whole",
    "guess:ane-call": "guess: 250 us per Core ML prediction on the Neural Engine (call, IOSurface input and "
                      "output transfers); not calibrated: no public per-call figure",
    "guess:cpu-bw": "guess: the CPU cores alone stream half the SoC's bandwidth, at most 200 GB/s",
}

_M1, _M1PM, _M1U = ("apple-m1",), ("apple-m1-pro-max",), ("apple-m1-ultra",)
_M2, _M2PM, _M2U = ("apple-m2",), ("apple-m2-pro-max",), ("apple-m2-ultra",)
_M3 = ("apple-m3", "derived:tflops")
_M4, _M4PM = ("apple-m4", "derived:tflops"), ("apple-m4-pro-max", "derived:tflops")
_COMMON = ("guess:launch", "guess:ane-call", "guess:cpu-bw")

PROFILES: dict[str, Profile] = {p.name: p for p in (
    Profile("m1", "M1 (8-core GPU)", 68.25, 8, 2.6, 11.0, _M1 + _COMMON),
    Profile("m1-pro", "M1 Pro (16-core GPU)", 200.0, 16, 5.2, 11.0, _M1PM + _COMMON),
    Profile("m1-max", "M1 Max (32-core GPU)", 400.0, 32, 10.4, 11.0, _M1PM + _COMMON),
    Profile("m1-ultra", "M1 Ultra (64-core GPU)", 800.0, 64, 21.0, 22.0, _M1U + _COMMON),
    Profile("m2", "M2 (10-core GPU)", 100.0, 10, 3.6, 15.8, _M2 + _COMMON),
    Profile("m2-pro", "M2 Pro (19-core GPU)", 200.0, 19, 6.8, 15.8, _M2PM + _COMMON),
    Profile("m2-max", "M2 Max (38-core GPU)", 400.0, 38, 13.6, 15.8, _M2PM + _COMMON),
    Profile("m2-ultra", "M2 Ultra (76-core GPU)", 800.0, 76, 27.2, 31.6, _M2U + _COMMON),
    Profile("m3", "M3 (10-core GPU)", 100.0, 10, 3.58, 18.0, _M3 + _COMMON),
    Profile("m3-pro", "M3 Pro (18-core GPU)", 150.0, 18, 6.45, 18.0, _M3 + _COMMON),
    Profile("m3-max", "M3 Max (40-core GPU)", 400.0, 40, 14.3, 18.0, _M3 + _COMMON),
    Profile("m4", "M4 (10-core GPU)", 120.0, 10, 3.84, 38.0, _M4 + _COMMON),
    Profile("m4-pro", "M4 Pro (20-core GPU)", 273.0, 20, 7.68, 38.0, _M4PM + _COMMON),
    Profile("m4-max", "M4 Max (40-core GPU)", 546.0, 40, 15.4, 38.0, _M4PM + _COMMON),
    Profile("m5", "M5 (10-core GPU)", 153.0, 10, 15.4, 38.0,
            ("apple-m5", "derived:m5-tflops", "guess:m5-ane") + _COMMON),
)}

# The profile `auto` is tuned under when a mid-range Mac is meant (a Mac mini / MacBook Pro class).
MID_RANGE = "m4-pro"


def get(name: str) -> Profile:
    """The profile called `name` (case and spaces ignored); ValueError names the known ones."""
    key = str(name).strip().lower().replace(" ", "-").replace("_", "-")
    if key not in PROFILES:
        raise ValueError(f"unknown cost profile {name!r}; known: {', '.join(PROFILES)} "
                         "(`edgespec bench --profile list` shows their sources)")
    return PROFILES[key]


def describe(p: Profile) -> list[str]:
    """Lines for `--profile list`: the numbers, then each source."""
    head = (f"{p.name:9s} {p.title:24s} {p.bandwidth_gbs:6.1f} GB/s  {p.gpu_tflops:5.1f} TFLOPS  "
            f"ANE {p.ane_tops:4.1f} TOPS  launch {p.launch_us:.0f} us")
    return [head] + [f"            {k}: {SOURCES[k]}" for k in p.sources]
