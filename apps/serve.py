"""`edgespec serve`: a local OpenAI-compatible HTTP server (see docs/server.md)."""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

from edgespec.apps.common import (
    add_cache_arguments,
    add_decoding_arguments,
    add_model_arguments,
    load_prompt_caches,
)

HELP = "serve the model over a local OpenAI-compatible HTTP API"
DESCRIPTION = (
    "Serve POST /v1/chat/completions, POST /v1/completions (JSON or server-sent events), "
    "GET /v1/models and GET /health. Concurrent requests are decoded together in one batch "
    "(--max-batch), admitted in arrival order; a client that disconnects cancels its generation. Binds to 127.0.0.1 unless --host says otherwise."
)


def add_arguments(p) -> None:
    from edgespec.distributed.launch import add_distributed_arguments  # deferred: CLI start-up

    add_model_arguments(p)
    add_distributed_arguments(p)
    add_decoding_arguments(p)  # server-side defaults for fields a request leaves out
    add_cache_arguments(p)
    n = p.add_argument_group("server")
    n.add_argument("--host", default="127.0.0.1",
                   help="address to bind; anything but a loopback address exposes the model to the network")
    n.add_argument("--port", type=int, default=8080, help="TCP port (0 = any free port, printed at start)")
    # The environment default is read in run(), so --help never prints a secret.
    n.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 requests; unset: $EDGESPEC_API_KEY, "
                   "and without either no check")
    n.add_argument("--max-batch", type=int, default=None,
                   help="generations decoded together in one batch (default: as many typical requests as "
                   "the memory budget holds, at most 8; 1 = strictly one after another)")
    n.add_argument("--max-queue", type=int, default=16,
                   help="requests allowed to wait beyond the running batch; more are refused with 503")
    n.add_argument("--model-id", default=None,
                   help="model name clients send (default: the bundle's folder name); 'default' always works")
    n.add_argument("--insecure-no-auth", "--allow-anyone", dest="allow_anyone", action="store_true",
                   help="serve a non-loopback --host without --api-key (anyone who reaches the port can use "
                   "the model); without this flag such a server refuses to start")
    n.add_argument("--allow-pull", action="store_true",
                   help="a request whose `model` is a hub name not stored here fetches it (otherwise 404); "
                   "stored models (`edgespec list`) are served on request either way")
    n.add_argument("--max-tokens-limit", type=int, default=8192,
                   help="largest max_tokens a request may ask for (larger ones get a 400)")
    n.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level (info logs every request)")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it reaches beyond this machine


def server_defaults(args) -> dict:
    """The decoding/sampling options given on the command line, as make_options keywords:
    the defaults for fields a request leaves out (validated now, not on the first request)."""
    from edgespec.apps.common import options_from_args  # deferred: CLI start-up

    o = options_from_args(args)
    sp = o.sampling
    defaults = dict(max_tokens=o.max_tokens, stop=o.stop or None, temperature=sp.temperature, top_k=sp.top_k,
                    top_p=sp.top_p, min_p=sp.min_p, seed=sp.seed, mode=o.mode, draft_tokens=o.draft_tokens,
                    **o.mode_options)
    return {k: v for k, v in defaults.items() if v is not None}


def run(args) -> int:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_batch is not None and args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.api_key is None:
        args.api_key = os.environ.get("EDGESPEC_API_KEY") or None
    if args.api_key is not None and not args.api_key.strip():
        raise ValueError("--api-key is empty")
    if args.max_tokens_limit < 1:
        raise ValueError(f"--max-tokens-limit must be >= 1, got {args.max_tokens_limit}")
    defaults = server_defaults(args)
    if not is_loopback(args.host):
        if not args.api_key and not args.allow_anyone:
            raise ValueError(
                f"--host {args.host} would let anyone who reaches this machine use the model: set --api-key "
                "(or $EDGESPEC_API_KEY), or pass --insecure-no-auth to serve without one"
            )
        print(f"edgespec serve: warning: binding {args.host} makes the model reachable from other machines"
              + ("" if args.api_key else "; anyone who can reach it can use it (--insecure-no-auth)"),
              file=sys.stderr)

    import uvicorn  # optional: uvicorn
    from edgespec.apps.common import load_engine  # deferred: CLI start-up
    from edgespec.apps.server import ServerSettings, create_app  # deferred: CLI start-up

    engine = None
    if args.distributed:  # start the ranks (mlx.launch), or join as one; only rank 0 binds and serves
        from edgespec.converters.default_model import default_bundle_path  # deferred: CLI start-up

        from edgespec.distributed.launch import join_or_launch  # deferred: CLI start-up

        code, engine = join_or_launch(args, default_bundle=default_bundle_path)
        if engine is None:
            return code
    # Bind before loading so a busy port fails fast, and so --port 0 reports the real port.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    # IPPROTO_TCP named: asyncio then sets TCP_NODELAY on each accepted connection (it skips
    # sockets of protocol 0), else Nagle held every kept-alive response back ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot bind {args.host}:{args.port}: {e.strerror}") from None
    engine = engine or load_engine(args)
    load_prompt_caches(engine, args)
    engine.max_batch = args.max_batch  # None: sized from the memory budget when the batcher starts
    model_id = args.model_id or (engine.loaded.path.name if engine.loaded.path else "model")
    if engine.loaded.path is not None and engine.loaded.path.is_file():
        model_id = args.model_id or engine.loaded.path.stem  # a GGUF file
    from edgespec.hub.names import as_hub_name  # deferred: CLI start-up

    if args.model_id is None and as_hub_name(args.model) is not None:
        model_id = str(as_hub_name(args.model))  # the name clients know, not the snapshot's commit
    settings = ServerSettings(model_id=model_id, api_key=args.api_key, max_waiting=args.max_queue,
                              defaults=defaults, max_tokens_limit=args.max_tokens_limit)
    app = create_app(engine, settings)
    if not args.distributed:  # other models stored by name, on request
        app = _shelf(app, args, settings)
    port = sock.getsockname()[1]
    shown = f"[{args.host}]" if family == socket.AF_INET6 else args.host
    print(f"edgespec serve: {model_id} on http://{shown}:{port}/v1", flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _shelf(app, args, settings):
    """The served app behind apps.server.shelf: models stored by name listed and loaded on request."""
    import copy  # deferred: CLI start-up
    import dataclasses  # deferred: CLI start-up

    from edgespec.apps.common import load_engine  # deferred: CLI start-up
    from edgespec.apps.server import create_app  # deferred: CLI start-up
    from edgespec.apps.server.shelf import ModelShelf  # deferred: CLI start-up

    def make_app(name: str):
        ns = copy.copy(args)
        ns.model, ns.drafter = name, None
        engine = load_engine(ns, progress=False)
        engine.max_batch = args.max_batch
        return create_app(engine, dataclasses.replace(settings, model_id=name))

    return ModelShelf(app, (settings.model_id, "default"), make_app, settings.api_key, settings.max_body_bytes,
                      allow_pull=args.allow_pull)
