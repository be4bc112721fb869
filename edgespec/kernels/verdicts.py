"""Every fast path proves itself where it runs: one verdict per (kernel, variant) and machine.

A kernel edgespec brings (a Metal shader, a native CPU pass, the BLAS shim's few-row product)
is used only after it was checked on the machine it runs on: against its reference for
correctness (a Metal kernel: compile, run on small inputs, compare), or against what it replaces
for speed (a CPU kernel: timed beside the library path, per shape class). The outcome is a
`Verdict`, kept in `$EDGESPEC_HOME/kernels/verdicts.json` for the machine it was reached on, so
the check runs once per (kernel, variant, machine), not once per process:

- ``native``: the fast path is checked and used;
- ``fallback``: it failed to build or disagreed with its reference: the reference runs instead;
- ``slower``: it is right but loses to what it replaces on this machine: that runs instead.

The machine is the scope: the CPU's model and SIMD flags, the device, MLX's version, the
kernels' revision and the preloaded libraries' contents (a rebuilt BLAS shim is checked afresh).
A file written under another scope is ignored (not deleted) and the checks run again; its entries are replaced on the next write. The file carries a checksum of its
entries: an edited or damaged file is ignored the same way. `edgespec doctor` lists the verdicts.

`decide(kernel, variant, check)` is the one entry point: the stored verdict, or `check()`'s,
stored; a `check` that raises gives a ``fallback`` verdict naming the error. Nothing here prints:
callers pass the one-line note on (a warning) where a user should see it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from edgespec.paths import home
from edgespec.safe_write import clean_stale_temps, temp_prefix

FORMAT = "edgespec-kernel-verdicts-1"
STATUSES = ("native", "fallback", "slower")
# Bumped when a kernel's source changes what its verdict would be (a verdict is about the code
# that was checked): verdicts reached under another revision are checked afresh.
REVISION = 1
_SIMD_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512vnni", "avx_vnni", "avx2", "fma", "f16c", "neon",
               "asimd", "asimddp", "i8mm", "bf16", "sve")


@dataclass(frozen=True)
class Verdict:
    kernel: str
    variant: str  # the dtype or shape class it was checked at ("" for one verdict per kernel)
    status: str  # one of STATUSES
    note: str = ""  # one line: why (the error, the timings compared)
    measured: dict = field(default_factory=dict)  # the figures behind a speed verdict

    @property
    def used(self) -> bool:
        return self.status == "native"


def _cpu() -> tuple[str, list[str]]:
    model, flags = platform.processor() or "", []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("model name", "hardware", "cpu model") and not model:
                    model = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = value.split()
    except OSError:
        pass
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        flags = flags or ["neon", "asimd"]
    return model, sorted(f for f in set(flags) if f in _SIMD_FLAGS)


def scope() -> dict:
    """What a verdict is about besides the kernel: this machine, device, MLX and kernel revision.
    EDGESPEC_CPU_FLAGS (a space-separated list) overrides the flags read from the CPU, for
    builds that were told to leave some out (e.g. AVX-512 disabled)."""
    model, flags = _cpu()
    forced = os.environ.get("EDGESPEC_CPU_FLAGS")
    if forced is not None:
        flags = sorted(set(forced.split()))
    return {"machine": platform.machine(), "system": platform.system(), "cpu": model, "flags": flags,
            "device": str(mx.default_device()), "mlx": getattr(mx, "__version__", ""), "revision": REVISION,
            "preload": preloaded_libraries(os.environ.get("LD_PRELOAD", ""))}


@functools.lru_cache(maxsize=8)
def preloaded_libraries(preload: str) -> list[str]:
    """Each preloaded library by name and a hash of its contents: a rebuilt BLAS shim (the same
    name, another kernel) is checked afresh."""
    out = []
    for item in sorted(i for i in re.split(r"[:\s]+", preload) if i):
        try:
            digest = hashlib.sha256(Path(item).read_bytes()).hexdigest()[:16]
        except OSError:
            digest = "unreadable"
        out.append(f"{Path(item).name}:{digest}")
    return out


def path() -> Path:
    return home() / "kernels" / "verdicts.json"


def _digest(entries: dict) -> str:
    return hashlib.sha256(json.dumps(entries, sort_keys=True).encode()).hexdigest()


def _key(kernel: str, variant: str) -> str:
    return f"{kernel}|{variant}"


def _as_verdict(raw) -> Verdict | None:
    try:
        v = Verdict(str(raw["kernel"]), str(raw["variant"]), str(raw["status"]), str(raw.get("note", "")),
                    dict(raw.get("measured", {})))
    except (KeyError, TypeError, ValueError):
        return None
    return v if v.status in STATUSES else None


class _Store:
    """This process's view of the file: read once, written whole (atomically) on each new verdict."""

    def __init__(self):
        self._lock = threading.RLock()
        self._loaded_from: Path | None = None
        self._scope: dict | None = None
        self.entries: dict[str, Verdict] = {}

    def _load(self) -> None:
        p = path()
        if self._loaded_from == p:
            return
        self._loaded_from, self._scope, self.entries = p, scope(), {}
        try:
            if p.is_symlink():
                return
            data = json.loads(p.read_text(encoding="utf-8"))
            raw = data["entries"]
            if data.get("format") != FORMAT or data.get("scope") != self._scope or data.get("sha256") != _digest(raw):
                return  # another machine's, an older revision's, or damaged: checked afresh
            for k, r in raw.items():
                v = _as_verdict(r)
                if v is not None and k == _key(v.kernel, v.variant):
                    self.entries[k] = v
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            self.entries = {}

    def get(self, kernel: str, variant: str) -> Verdict | None:
        with self._lock:
            self._load()
            return self.entries.get(_key(kernel, variant))

    def put(self, v: Verdict) -> bool:
        """Keep `v` (in this process at once; on disk atomically). False if the file could not be
        written (the verdict still holds for this process)."""
        if v.status not in STATUSES:
            raise ValueError(f"verdict status {v.status!r}: expected one of {', '.join(STATUSES)}")
        with self._lock:
            self._load()
            self.entries[_key(v.kernel, v.variant)] = v
            raw = {k: asdict(e) for k, e in sorted(self.entries.items())}
            data = {"format": FORMAT, "scope": self._scope, "sha256": _digest(raw), "entries": raw}
            p = path()
            tmp = None
            try:
                if p.is_symlink() or (p.exists() and not p.is_file()):
                    return False  # not ours to replace
                p.parent.mkdir(parents=True, exist_ok=True)
                clean_stale_temps(p)
                fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f"{temp_prefix(p)}{os.getpid()}-")
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1, default=str)
                os.replace(tmp, p)
                return True
            except OSError:
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)
                return False

    def all(self) -> list[Verdict]:
        with self._lock:
            self._load()
            return sorted(self.entries.values(), key=lambda v: (v.kernel, v.variant))

    def forget(self) -> None:
        """Read the file again at the next look-up (tests; a changed EDGESPEC_HOME)."""
        with self._lock:
            self._loaded_from = None


_STORE = _Store()


def get(kernel: str, variant: str = "") -> Verdict | None:
    return _STORE.get(kernel, variant)


def put(verdict: Verdict) -> bool:
    return _STORE.put(verdict)


def all_verdicts() -> list[Verdict]:
    return _STORE.all()


def forget() -> None:
    _STORE.forget()


def decide(kernel: str, variant: str, check: Callable[[], Verdict]) -> Verdict:
    """The verdict for (kernel, variant) on this machine: the stored one, else `check()`'s (kept).
    A `check` that raises gives (and keeps) a ``fallback`` verdict naming the error in one line."""
    with _STORE._lock:
        v = _STORE.get(kernel, variant)
        if v is not None:
            return v
        try:
            v = check()
        except Exception as e:  # noqa: BLE001 - any failure of a fast path means: use the reference
            first = (str(e).strip().splitlines() or [""])[0][:200]
            v = Verdict(kernel, variant, "fallback", f"{type(e).__name__}: {first}")
        if (v.kernel, v.variant) != (kernel, variant):
            v = Verdict(kernel, variant, v.status, v.note, v.measured)
        _STORE.put(v)
        return v


def checks_on() -> bool:
    """Whether CPU kernels are timed against what they replace (EDGESPEC_KERNEL_CHECKS, default on;
    off: every kernel runs as built, as the test suite has it, so no test depends on a timing)."""
    return os.environ.get("EDGESPEC_KERNEL_CHECKS", "on").strip().lower() not in ("0", "off", "false", "no")


def race(kernel: str, variant: str, fast: Callable[[], object], replaced: Callable[[], object],
         reps: int = 5, what: str = "what it replaces") -> Verdict:
    """A speed verdict: `fast` (a kernel's path, run to completion) timed against `replaced` (the
    path it replaces), alternating call by call so both meet the same load, one warm-up each;
    the medians compared: ``native`` when the kernel is no slower, else ``slower``."""
    import time

    times: dict[bool, list[float]] = {True: [], False: []}
    for rep in range(reps + 1):
        for on in ((True, False) if rep % 2 else (False, True)):
            t0 = time.perf_counter()
            (fast if on else replaced)()
            if rep:  # the first of each is a warm-up
                times[on].append(time.perf_counter() - t0)
    mine, theirs = (sorted(times[k])[len(times[k]) // 2] for k in (True, False))
    return Verdict(kernel, variant, "native" if mine <= theirs else "slower",
                   f"{mine * 1e3:.2f} ms against {what}'s {theirs * 1e3:.2f} ms",
                   {"kernel_ms": round(mine * 1e3, 3), "replaced_ms": round(theirs * 1e3, 3)})
