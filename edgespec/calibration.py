"""Pass costs learnt from real rounds, kept per (model, device, machine) so the next process starts warm.

The decoders that choose what to verify (`auto`, speculative, tree) price a verifier pass
over T tokens and a drafted token in seconds. Nothing is measured before the first token:
each engine holds one `CostStore` whose curve (`estimate.Costs`) starts from

- the curve persisted by an earlier process for the same model on this machine
  (`$EDGESPEC_HOME/calibration/<model>-<key hash>.json`), else
- a prior: a plain step of PRIOR_STEP_S seconds and a cost that grows by PRIOR_SLOPE of a
  step per extra token (steeper on a CPU than on an accelerator: conservative, so only
  likely candidates are verified until passes have been measured), and a drafted token
  costing a plain step times DRAFT_PRIOR_FACTOR times the drafter's share of the verifier's
  weight bytes, between 0.05 and 1 (the default model's shipped drafter: a share of 0.087, so
  0.13 of a step; it measured 0.087 of a step on the 2-core machine); DRAFT_PRIOR of a step when that share is
  unknown (a drafter without MLX weights),

and learns from every pass run alone: plain steps give T = 1, tree and speculative rounds
their own T, drafting its seconds per token and, apart, per committed token the drafter had
not seen before the call (its catch-up, `DraftCost`; a file written before that term existed
loads, its per-token figures unused: they held catch-up time). Unmeasured sizes follow the measured ones
(`Costs.verify`). What was learnt is written back (atomically: a temp file, then
`os.replace`) after a request once enough is new, at most every SAVE_EVERY_S seconds, and
at exit. Files are treated as the history store treats its own (edgespec.safe_write's rule:
replace only what edgespec wrote): a damaged file (not JSON, not this format, bad values) is
ignored with a logged warning and moved aside to `<name>.corrupt` (`-1`, `-2`... never
overwritten); one written for another key, a link or anything unreadable is ignored with a
warning and left as it is, and this process learns in memory only; a failed write (full disk,
no permission) is a warning; temps of killed writers are removed at the next write.

The key holds what changes costs: the model (its weight files' hashes from the bundle
manifest, else the file's name, size and modification time), its shape and dtypes, the MLX
device, the machine (architecture, CPU model, CPUs usable, the preloaded BLAS by its
contents, thread and kernel settings), the edgespec and MLX versions and the kernels' cost
revision (`edgespec.kernels.COSTS_REVISION`). Engines built in memory (no model path, as in the
tests) learn in memory only. `EDGESPEC_CALIBRATION=off` turns reading and writing off.

About 480 lines: the store, its key, and the careful file handling above belong together;
the curve's arithmetic is adaptive/estimate.py.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import math
import os
import platform
import re
import tempfile
import threading
import time
import weakref
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

import edgespec.sealed as sealed
from edgespec.adaptive.estimate import DRAFT_PRIOR, Costs, DraftCost
from edgespec.costs.clock import active as simulation
from edgespec.kernels import COSTS_REVISION
from edgespec.kernels.verdicts import preloaded_libraries
from edgespec.paths import home as edgespec_home
from edgespec.safe_write import aside_name, clean_stale_temps, temp_prefix
from edgespec.tree import (
    controller as tree_controller,  # calibrate_tree looked up per call (tests forbid it)
)
from edgespec.tree.controller import TreeCosts
from edgespec.version import __version__
from edgespec.weights.identity import model_identity

log = logging.getLogger("edgespec.calibration")

# 2: the verify curve is persisted at quiet prices (Costs.quiet). Format-1 files priced sizes
# timed under contention for good; their key (and so their file name) differs, so they are not read.
# 3: the curve is kept at an empty context and the context's price beside it ("ctx_s",
# Costs.ctx_term): format-2 curves hold each size at whatever context it was timed at.
# 4: sealed with a SHA-256 of the content (edgespec.sealed): an edited or damaged file is refused.
FORMAT = 4
# The curve's grid: every size up to 16 (a CPU BLAS can run 16 rows faster than 12), then coarser.
# (Measured: CPU, 2-core x86 with OpenBLAS; on a GPU a guess.)
SIZES = tuple(range(1, 17)) + (20, 24, 32, 48, 64)
PRIOR_STEP_S = 0.05  # seconds of a plain step before one is measured (a guess: only ratios matter until then)
# Extra cost per extra token, in plain steps, before a pass is measured. "cpu": measured (2-core
# x86, default model, the curve before the few-row kernel); "gpu": a guess, the roofline's slope
# for the default model at q4_0 on the mid-range profile is in edgespec.costs.priors (METAL_PRIORS).
PRIOR_SLOPE = {"cpu": 0.08, "gpu": 0.02}
# How much of the context's price grows with a pass's width (Costs.ctx_share). "cpu": attention
# over L for each of T positions is compute there (a guess from its flops); "gpu": the cache is
# read once for every position (the roofline, edgespec.costs.model).
CTX_SHARE = {"cpu": 1.0, "gpu": 0.1}
DRAFT_PRIOR_FACTOR = 1.5  # ... else this times the drafter's share of the verifier's weight bytes
SAVE_EVERY_S = 30.0  # a long-running server writes at most this often (and at exit)
SAVE_AFTER = 8  # new measurements before a write after a request
PUBLISH_CHANGE = 0.1  # relative change of the curve at some size that republishes it (batcher)
ENV = "EDGESPEC_CALIBRATION"


def enabled() -> bool:
    """Whether learnt costs are read from and written to $EDGESPEC_HOME ($EDGESPEC_CALIBRATION)."""
    return os.environ.get(ENV, "on").strip().lower() not in ("off", "0", "no", "false")


def device_kind() -> str:
    return "gpu" if mx.default_device().type == mx.DeviceType.gpu else "cpu"


def prior_curve(sizes=SIZES, kind: str | None = None, step_s: float = PRIOR_STEP_S) -> list[float]:
    slope = PRIOR_SLOPE[kind or device_kind()]
    return [step_s * (1.0 + slope * (T - 1)) for T in sizes]



def weight_bytes(model) -> int:
    """Bytes of an MLX model's parameters (0 when it has none that can be read)."""
    if model is None or not hasattr(model, "parameters"):
        return 0
    try:
        return sum(int(v.nbytes) for _, v in tree_flatten(model.parameters()))
    except Exception:  # noqa: BLE001  (no MLX parameters: unknown)
        return 0


def _weights_of(drafter):
    """The drafter's own MLX model (Drafter.model), None for one without weights; priced from any
    object with a name (a caller's stand-in may declare nothing else)."""
    return getattr(drafter, "model", None)


def drafter_key(drafter) -> str:
    """What tells drafters apart in the persisted file: its name and its weights' size."""
    return f"{drafter.name}:{weight_bytes(_weights_of(drafter))}"


def draft_prior(drafter, verifier_bytes: int) -> float:
    """Seconds per drafted token before one is measured, in plain steps: DRAFT_PRIOR_FACTOR x
    the drafter's share of the verifier's weight bytes (decoding small models is about
    reading their weights), within 0.05..1; DRAFT_PRIOR when the share is unknown."""
    mine = weight_bytes(_weights_of(drafter))
    if not mine or not verifier_bytes:
        return DRAFT_PRIOR
    return min(max(DRAFT_PRIOR_FACTOR * mine / verifier_bytes, 0.05), 1.0)


# ---------------------------------------------------------------------------- the key
def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def machine_identity() -> dict:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    device = mx.default_device()
    out = {
        "machine": platform.machine(),
        "system": platform.system(),
        "cpu": _cpu_model(),
        "cpus": cpus,
        "device": str(device),
        "preload": preloaded_libraries(os.environ.get("LD_PRELOAD", "")),  # a rebuilt shim prices afresh
        "threads": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                               "EDGESPEC_SKINNY", "EDGESPEC_NATIVE", "EDGESPEC_BASE2") if k in os.environ},
        "mlx": getattr(mx, "__version__", ""),
        "kernels": COSTS_REVISION,
    }
    if device.type == mx.DeviceType.gpu:
        try:
            out["gpu"] = str(mx.metal.device_info().get("device_name", ""))
        except Exception:  # noqa: BLE001  (no Metal details: the device string stands)
            pass
    return out


def cost_key(loaded) -> dict | None:
    ident = model_identity(loaded)
    if ident is None:
        return None
    return {"format": FORMAT, "edgespec": __version__, "model": ident, "machine": machine_identity()}


def key_path(key: dict, home: Path | None = None) -> Path:
    if home is None:
        home = edgespec_home()
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", str(key["model"]["name"]))[:60] or "model"
    return Path(home) / "calibration" / f"{slug}-{digest}.json"


# ---------------------------------------------------------------------------- the store
def _plain(key):
    """The key as it reads back from JSON (tuples as lists, anything else as its str)."""
    return json.loads(json.dumps(key, default=str))


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _nonnegative(v) -> bool:
    return _positive(v) or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


class CostStore:
    """One engine's learnt costs: the verify curve (`costs`, shared by every decoder on the
    engine), seconds per drafted token per drafter, and the file they persist in."""

    def __init__(self, key: dict | None = None, path: Path | None = None, kind: str | None = None):
        self.key, self.path = key, path
        self.kind = kind or device_kind()
        self.loaded_verify: dict[int, float] = {}
        self.loaded_counts: dict[int, int] = {}
        self.loaded_drafts: dict[str, float] = {}
        self.loaded_catch: dict[str, float | None] = {}  # per drafter: its catch-up (None: unmeasured)
        self.loaded_ctx = 0.0  # the context's price per position (Costs.ctx_s)
        if path is not None:
            self._load()
        prior = Costs(list(SIZES), prior_curve(SIZES, self.kind))
        for T, v in self.loaded_verify.items():
            prior.observe(T, v)
        sizes = sorted(set(SIZES) | {T for T in self.loaded_verify if T <= SIZES[-1]})
        self.costs = Costs(sizes, [prior.verify(T) for T in sizes], anchored=set(self.loaded_verify),
                           ctx_s=self.loaded_ctx, ctx_share=CTX_SHARE.get(self.kind, 1.0))
        # A drafter's per-token figure loads only with its catch-up entry beside it: one written
        # before the catch-up was priced apart (no such entry) holds catch-up time, so it is not
        # used (the weight-share prior applies until a call is timed), and kept in the file.
        self.drafts: dict[str, DraftCost] = {k: DraftCost(v, self.loaded_catch[k])
                                             for k, v in self.loaded_drafts.items() if k in self.loaded_catch}
        self._saved_at = 0.0
        self._saved_counts = 0
        self._counted: dict[int, int] = {}  # this process's measurements per size already in the file
        self._warned: set = set()  # errnos of failed writes already reported
        self._lock = threading.Lock()
        self._published = None
        self.verifier_bytes = 0  # the verifier's weight bytes (drafters' priors), set by cost_store

    @property
    def warm(self) -> bool:
        """Whether the curve started from an earlier process's measurements."""
        return bool(self.loaded_verify)

    def _load(self) -> None:
        p = self.path
        if not os.path.lexists(p):
            return
        try:
            if p.is_symlink() or not p.is_file():
                raise OSError("not a regular file")
            raw = p.read_bytes()
        except OSError as e:
            self._refuse(f"could not read it ({e})")
            return
        try:
            data = json.loads(raw.decode("utf-8"))
            if not isinstance(data, dict) or data.get("format") != FORMAT or "key" not in data:
                raise ValueError(f"not a format-{FORMAT} edgespec calibration file")
            data = sealed.unseal(data)
            if data is None:
                raise ValueError("its checksum does not match its content (edited or damaged)")
            verify, counts, drafts = data.get("verify"), data.get("counts", {}), data.get("draft", {})
            catch = data.get("catch_up", {})  # absent in files written before it was priced apart
            if not all(isinstance(x, dict) for x in (verify, counts, drafts, catch)):
                raise ValueError("'verify', 'counts', 'draft' and 'catch_up' must be objects")
            out = {}
            for k, v in verify.items():
                T = int(k)
                if not 1 <= T <= 4096 or not _positive(v):
                    raise ValueError(f"bad verify entry {k!r}: {v!r}")
                out[T] = float(v)
            for k, v in drafts.items():
                if not _positive(v):
                    raise ValueError(f"bad draft entry {k!r}: {v!r}")
            for k, v in catch.items():
                if v is not None and not _nonnegative(v):
                    raise ValueError(f"bad catch_up entry {k!r}: {v!r}")
            loaded_counts = {int(k): int(v) for k, v in counts.items() if isinstance(v, int)}
            ctx = data.get("ctx_s", 0.0)
            if not _nonnegative(ctx):
                raise ValueError(f"bad ctx_s: {ctx!r}")
        except (ValueError, TypeError) as e:
            aside = aside_name(p)
            try:
                os.replace(p, aside)
            except OSError as err:
                self._refuse(f"it is damaged ({e}) and could not be moved aside ({err})")
                return
            log.warning("edgespec: ignoring the calibration file %s (damaged: %s); kept it as %s, costs are "
                        "learnt afresh", p, e, aside.name)
            return
        if data.get("key") != _plain(self.key):
            self._refuse("it was written for another model, device or machine")
            return
        self.loaded_verify = out
        self.loaded_counts = loaded_counts
        self.loaded_drafts = {str(k): float(v) for k, v in drafts.items()}
        self.loaded_catch = {str(k): None if v is None else float(v) for k, v in catch.items()}
        self.loaded_ctx = float(ctx)

    def _refuse(self, why: str) -> None:
        log.warning("edgespec: ignoring the calibration file %s (%s); leaving it as it is, costs are learnt "
                    "in memory only", self.path, why)
        self.path = None

    def draft(self, drafter) -> DraftCost:
        """The learnt cost of this drafter (its entry created on first use)."""
        key = drafter_key(drafter)
        d = self.drafts.get(key)
        if d is None:
            d = self.drafts[key] = DraftCost()
        d.busy = self.costs.busy  # persisted: the calls made while the cores were not busy
        if d.per_token is None:
            d.prior = draft_prior(drafter, self.verifier_bytes)
        return d

    # ------------------------------------------------------------------ persisting
    def _new(self) -> int:
        return sum(self.costs.counts.values()) + sum(d.count for d in self.drafts.values())

    def maybe_save(self) -> None:
        """After a request: write when enough is new, at most every SAVE_EVERY_S seconds
        (the first time as soon as anything was measured)."""
        if self.path is None:
            return
        new = self._new() - self._saved_counts
        if new <= 0:
            return
        if self._saved_at and (new < SAVE_AFTER or time.monotonic() - self._saved_at < SAVE_EVERY_S):
            return
        self.save()

    def save(self) -> bool:
        """Write what was learnt (merged over the file's entries for sizes not measured here)."""
        if self.path is None:
            return False
        with self._lock:
            seen, counts = self.costs.quiet(), dict(self.costs.counts)
            if not seen and not any(d.fresh for d in list(self.drafts.values())):
                return False
            total = self._new()
            verify = dict(self.loaded_verify)
            all_counts = dict(self.loaded_counts)
            drafts = dict(self.loaded_drafts)
            catch = dict(self.loaded_catch)
            current = self._read_entries()
            if current is not None:  # another process may have written since we loaded
                verify.update(current[0])
                all_counts.update(current[1])
                drafts.update(current[2])
                catch.update(current[3])
            for T, v in seen.items():
                if not counts.get(T):
                    continue  # set here without a measurement (never happens today): keep the file's
                verify[T] = v
                all_counts[T] = all_counts.get(T, 0) + counts[T] - self._counted.get(T, 0)
            for k, d in list(self.drafts.items()):
                quiet = d.quiet() if d.fresh else None  # fitted to the calls made on quiet cores
                if quiet is not None:
                    catch[k], drafts[k] = quiet  # beside it: this per-token figure excludes catch-up
            data = sealed.seal({"format": FORMAT, "key": self.key, "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                "verify": {str(T): verify[T] for T in sorted(verify)},
                                "counts": {str(T): all_counts[T] for T in sorted(all_counts)},
                                "draft": drafts, "catch_up": catch, "ctx_s": self.costs.ctx_s})
            tmp = None
            try:
                if os.path.lexists(self.path) and current is None:
                    # Something else took the name since we read it: never written over.
                    self._refuse("it is no longer an edgespec calibration file for this key")
                    return False
                self.path.parent.mkdir(parents=True, exist_ok=True)
                clean_stale_temps(self.path)  # of writers killed mid-save
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f"{temp_prefix(self.path)}{os.getpid()}-")
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1, default=str)
                os.replace(tmp, self.path)
            except OSError as e:
                if tmp is not None:
                    Path(tmp).unlink(missing_ok=True)
                if e.errno not in self._warned:
                    self._warned.add(e.errno)
                    log.warning("edgespec: could not write the calibration file %s (%s); it is as it was",
                                self.path, e)
                self._saved_at = time.monotonic()  # not again at once
                return False
            self._saved_at = time.monotonic()
            self._saved_counts = total
            self._counted = counts
            return True

    def _read_entries(self):
        """The file's current entries when it is ours (same key), else None."""
        try:
            if self.path.is_symlink():
                return None
            data = sealed.unseal(json.loads(self.path.read_text(encoding="utf-8")))
            if data is None or data.get("format") != FORMAT or data.get("key") != _plain(self.key):
                return None
            verify = {int(k): float(v) for k, v in data["verify"].items() if _positive(v)}
            counts = {int(k): int(v) for k, v in data.get("counts", {}).items() if isinstance(v, int)}
            drafts = {str(k): float(v) for k, v in data.get("draft", {}).items() if _positive(v)}
            catch = {str(k): None if v is None else float(v) for k, v in data.get("catch_up", {}).items()
                     if v is None or _nonnegative(v)}
            return verify, counts, drafts, catch
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            return None

    # ------------------------------------------------------------------ for the batcher
    def publish(self, engine) -> None:
        """Put the current curve where the batcher prices steps (the engine's
        `memory.tree_costs`), when it is new or has moved by PUBLISH_CHANGE somewhere
        (each new object makes the batcher rebuild its step costs)."""
        sizes = list(self.costs.sizes)
        now = [self.costs.verify_at(T, 0) for T in sizes]
        old = self._published
        if old is not None and engine.memory.tree_costs is old and all(
                abs(a - b) <= PUBLISH_CHANGE * b for a, b in zip(now, old.verify_s, strict=True)):
            return
        self._published = engine.memory.tree_costs = TreeCosts(sizes, now)


_STORES: weakref.WeakSet = weakref.WeakSet()


def _save_all() -> None:
    for store in list(_STORES):
        try:
            store.save()
        except Exception:  # noqa: BLE001  (never fail an exit over a cache)
            log.exception("edgespec: saving the calibration failed")


atexit.register(_save_all)


def cost_store(engine) -> CostStore:
    """The engine's CostStore (created on first use: reads the persisted file, measures nothing)."""
    store = engine.memory.cost_store
    sim = simulation()
    if store is None and sim is not None:
        # Under a cost profile (edgespec.costs.clock.simulate): the profile's curve at a typical
        # context, learnt further from the simulated passes, never written to the host's file.
        store = engine.memory.cost_store = CostStore(None, None, kind="gpu")
        store.costs = Costs(list(SIZES), sim.curve(SIZES, L=0), ctx_s=sim.context_s(), ctx_share=CTX_SHARE["gpu"])
        store.verifier_bytes = weight_bytes(engine.model)
        return store
    if store is None:
        key = path = None
        if enabled():
            try:
                key = cost_key(engine.loaded)
            except Exception as e:  # noqa: BLE001  (no key: learn in memory only)
                log.warning("edgespec: no calibration key for this model (%s); costs are learnt in memory only", e)
                key = None
            path = key_path(key) if key is not None else None
        store = engine.memory.cost_store = CostStore(key, path)
        store.verifier_bytes = weight_bytes(engine.model)
        if path is not None:
            _STORES.add(store)
    return store


def measure(engine, reps: int = 1) -> CostStore:
    """The explicit measurement (benchmarks, or to fill the curve at once): times tree passes
    over every size of the grid (`calibrate_tree`) and records them as measurements."""
    store = cost_store(engine)
    tree = tree_controller.calibrate_tree(engine.model, SIZES[-1], context=128, reps=reps, sizes=SIZES, monotone=False)
    for T, v in zip(tree.sizes, tree.verify_s, strict=True):
        store.costs.replace(T, v)
    store.publish(engine)
    return store
