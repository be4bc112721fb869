"""Starting the ranks: `--distributed HOSTFILE` on the CLI (through mlx.launch), local rings for tests.

`edgespec generate|chat|serve --distributed HOSTFILE ...` started by hand re-runs the same
command on every host of HOSTFILE through mlx.launch (ring backend); inside a rank
(MLX_RANK set by the launcher) the same command joins the group instead: rank 0 gets an
Engine over the sharded verifier and does the app's work, the others follow. HOSTFILE is
mlx.launch's JSON host list (see docs/distributed.md); `local:N` runs N ranks on this machine.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import edgespec.distributed as dist
from edgespec.distributed.errors import DistributedError

DISTRIBUTED_HELP = (
    "shard the verifier over the hosts of HOSTFILE (mlx.launch's JSON host list, ring backend) "
    "or over N local processes (local:N); rank 0 runs this command, the others hold their "
    "shard of the weights. Without --model: the default model, converted once to a bundle the ranks "
    "share. See docs/distributed.md"
)
SPLIT_HELP = "how the verifier is sharded: pipeline (layer ranges per rank) or tensor (heads and MLP columns split)"


def add_distributed_arguments(p) -> None:
    g = p.add_argument_group("distributed")
    g.add_argument("--distributed", metavar="HOSTFILE", default=None, help=DISTRIBUTED_HELP)
    g.add_argument("--distributed-split", choices=["pipeline", "tensor"], default="pipeline", help=SPLIT_HELP)


def free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ring_hostfile(n: int, folder: str | Path | None = None) -> Path:
    """A ring-backend hostfile ($MLX_HOSTFILE) for n ranks on 127.0.0.1, on free ports."""
    hosts = [[f"127.0.0.1:{p}"] for p in free_ports(n)]
    fd, path = tempfile.mkstemp(prefix="edgespec-ring-", suffix=".json", dir=folder)
    with os.fdopen(fd, "w") as f:
        json.dump(hosts, f)
    return Path(path)


def spawn_local(n: int, argv: list[str], env: dict | None = None, **popen) -> list[subprocess.Popen]:
    """Start `argv` as ranks 0..n-1 of a local ring (what mlx.launch does for 127.0.0.1 hosts)."""
    hostfile = ring_hostfile(n)
    procs = []
    for rank in range(n):
        e = dict(os.environ if env is None else env)
        e.update(MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        procs.append(subprocess.Popen(argv, env=e, **popen))
    return procs


def _launcher_argv(spec: str, argv: list[str]) -> list[str]:
    launcher = [sys.executable, "-c", "import sys; from mlx._distributed_utils.launch import main; sys.exit(main())"]
    m = re.fullmatch(r"local:(\d+)", spec)
    if m:
        n = int(m.group(1))
        if not 1 <= n <= 64:
            raise DistributedError(f"--distributed {spec}: use local:N with N in 1..64")
        hosts = ["--hosts", "127.0.0.1", "-n", str(n), "--starting-port", str(free_ports(1)[0])]
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise DistributedError(f"--distributed {spec}: no such hostfile (a JSON host list for mlx.launch, or local:N)")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise DistributedError(f"--distributed {spec}: not a JSON hostfile ({e})") from None
        hosts_list = data.get("hosts") if isinstance(data, dict) else data
        if not isinstance(hosts_list, list) or not all(isinstance(h, dict) and h.get("ips") for h in hosts_list):
            raise DistributedError(
                f'--distributed {spec}: expected [{{"ssh": HOST, "ips": [IP, ...]}}, ...] (mlx.distributed_config writes one)'
            )
        hosts = ["--hostfile", str(path)]
    return [*launcher, *hosts, "--backend", "ring", "--", sys.executable, "-m", "edgespec.cli", *argv]


def launch(spec: str, argv: list[str]) -> int:
    """Run `edgespec ARGV` on every rank through mlx.launch; non-zero when any rank failed.

    mlx.launch stops the other ranks when one exits with an error, but itself exits 0;
    its warning lines ("Node with rank N exited with code C") tell us what happened.
    """
    proc = subprocess.Popen(_launcher_argv(spec, argv), stderr=subprocess.PIPE, text=True, errors="replace")
    failed = False
    for line in proc.stderr:
        if re.search(r"Node with rank \d+ (exited with code|was killed)", line):
            failed = True
        sys.stderr.write(line)
        sys.stderr.flush()
    code = proc.wait()
    return code or (1 if failed else 0)


def join_or_launch(args, argv: list[str] | None = None, default_bundle=None):
    """(exit code, None) when this process only launched the group or followed; (None, engine) on rank 0.

    default_bundle: a function giving the default model's bundle path (the apps pass the
    converter's, which fetches and converts it once; the runtime never imports converters)."""
    if "MLX_RANK" not in os.environ:
        argv = list(sys.argv[1:] if argv is None else argv)
        if args.model is None:
            # The default model: a bundle of it in the cache (fetched and converted once, here,
            # before the ranks start), named to every rank by its path.
            if default_bundle is None:
                raise DistributedError("--distributed needs --model BUNDLE here (no default model bundle given)")
            argv += ["--model", str(default_bundle())]
        return launch(args.distributed, argv), None
    from edgespec.lookahead.memory import parse_size  # deferred: CLI start-up
    from edgespec.weights.default_model import default_bundle_dir  # deferred: CLI start-up

    if args.model is None:
        args.model = default_bundle_dir()
        if not (args.model / "manifest.json").is_file():
            raise DistributedError(
                f"this rank has no bundle of the default model at {args.model}: start the group with "
                "`edgespec ... --distributed` (it converts the default model once before the ranks start), "
                "or pass --model BUNDLE (at the same path on every host)")
    budget = parse_size(getattr(args, "memory_budget", None))
    engine = dist.load(args.model, split=args.distributed_split, drafter=getattr(args, "drafter", None),
                       history=getattr(args, "history", None))
    if engine is None:
        return 0, None
    if budget:
        engine.limit_memory(budget)
    return None, engine
