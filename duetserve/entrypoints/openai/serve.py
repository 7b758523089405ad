"""`duet serve [MODEL]`: the OpenAI-compatible HTTP server.

    duet serve                                  # default model on 127.0.0.1:8000
    duet serve ./my-model.gguf --port 9000 --api-key secret
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The sky is", "max_tokens": 16}'
"""
from __future__ import annotations

import argparse
import gc
import logging
import os

from duetserve.entrypoints.cli import UserError
from duetserve.entrypoints.engine_args import add_engine_arguments, build_engine
from duetserve.entrypoints.shared_args import add_bind_arguments, add_kv_backend_argument
from duetserve.entrypoints.web import page_url
from duetserve.errors import LoRAError
from duetserve.kv_transfer.config import COMPRESSIONS, ROLES


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, positional_model=True)
    s = p.add_argument_group("server")
    add_bind_arguments(s, 8000, "server")
    s.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the checkpoint's file/folder stem)")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (default: env DUET_API_KEY)")
    s.add_argument("--max-request-bytes", type=int, default=4 * 2**20,
                   help="larger request bodies get 413 before parsing (default %(default)s)")
    s.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT, seconds in-flight requests may take to finish "
                        "before they are ended with an error (default %(default)s)")
    s.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection may take to send complete request headers "
                        "(also idle connections before a request; 408) and between body "
                        "reads (default %(default)s)")
    s.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="close an idle keep-alive connection after this many seconds "
                        "(default %(default)s)")
    d = p.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    d.add_argument("--role", default="both", choices=list(ROLES),
                   help="both (default): colocated; prefill: compute prompts' KV and first "
                        "tokens for decode instances; decode: continue from a prefill "
                        "instance's KV. Put `duet router` in front of them")
    add_kv_backend_argument(d, "shm", "how a decode instance reads KV: shm (same host) or "
                            "mooncake (Mooncake Transfer Engine over TCP, any host)")
    d.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="seconds a prefill instance holds a request's KV for a decode "
                        "instance before freeing it; also a decode instance's limit on one "
                        "read (default %(default)s)")
    d.add_argument("--kv-transfer-host", default=None,
                   help="address Mooncake publishes for this instance (default: --host, "
                        "or 127.0.0.1 when binding 0.0.0.0)")
    d.add_argument("--kv-transfer-compression", default="none", choices=list(COMPRESSIONS),
                   help="prefill: send KV as int8 with a scale per token and head (about "
                        "1/4 of float32 bytes; lossy, see docs/results.md)")
    d.add_argument("--no-mooncake", dest="mooncake", action="store_false",
                   help="a prefill instance serves shared memory only (no Mooncake)")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    s.add_argument("--print-config", action="store_true",
                   help="build the engine (start-up measurements included), print the "
                        "resolved configuration as JSON and exit; the output works as "
                        "--step-time to schedule the same way on another start or machine")


def served_name(model_arg: str | None) -> tuple[str, str]:
    """(served model name, resolved checkpoint path) of the --model/MODEL argument."""
    from duetserve.loader import resolve_model_path
    path = resolve_model_path(model_arg)
    base = os.path.basename(os.path.normpath(path))
    stem = base if os.path.isdir(path) else os.path.splitext(base)[0]
    return stem, path


def kv_transfer_config(args: argparse.Namespace):
    from duetserve.config import ConfigError
    from duetserve.kv_transfer import KVTransferConfig
    host = args.kv_transfer_host or (args.host if args.host not in ("0.0.0.0", "::")
                                     else "127.0.0.1")
    try:
        return KVTransferConfig(args.role, args.kv_transfer_backend,
                                args.kv_transfer_timeout, host, args.mooncake,
                                args.kv_transfer_compression)
    except ConfigError as e:
        raise UserError(str(e)) from None


def build_server(args: argparse.Namespace):
    """The engine, the app and the uvicorn server for `duet serve`'s flags (not started):
    a DrainingServer whose `config.app.state.ctx` is the ServerContext. `duet serve` runs
    it in the main thread; a Ray instance (duetserve/cluster/instance.py) in a thread.
    Raises UserError for bad flags or a checkpoint/transfer backend that cannot start."""
    import uvicorn

    from duetserve.engine.async_engine import AsyncEngine
    from duetserve.entrypoints.openai.api_server import build_app
    from duetserve.entrypoints.openai.http_guard import (DrainingServer, drain,
                                                         header_timeout_protocol)

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("max_request_bytes", "shutdown_timeout", "header_timeout",
                 "timeout_keep_alive"):
        if not getattr(args, name) > 0:
            raise UserError(f"--{name.replace('_', '-')} must be > 0, got "
                            f"{getattr(args, name)}")
    kv_transfer = kv_transfer_config(args)
    # A server logs how it set itself up (model, kernels and why, KV cache, step budget)
    # and its throughput every few seconds.
    logging.getLogger("duetserve").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Built on the thread that will step it (AsyncEngine.build says why).
    engine = AsyncEngine.build(lambda: build_engine(args, kv_transfer))
    core = engine.engine
    try:
        name, path = served_name(getattr(args, "model_pos", None) or args.model)
        name = args.served_model_name or name
        api_key = args.api_key or os.environ.get("DUET_API_KEY") or None
        try:
            app = build_app(engine, name, api_key, path,
                            max_request_bytes=args.max_request_bytes,
                            read_timeout=args.header_timeout)
        except LoRAError as e:            # a bad --lora-modules adapter
            raise UserError(f"--lora-modules: {e}") from None
        log = logging.getLogger("duetserve.serve")
        log.info("serving %s at http://%s:%d/v1 (max_model_len %d%s)", name, args.host,
                 args.port, core.max_model_len, ", API key required" if api_key else "")
        log.info("open %s in a browser to chat, %s for the live dashboard",
                 page_url(args.host, args.port), page_url(args.host, args.port, "/dashboard"))
        ctx = app.state.ctx
        # Everything built so far (weights' Python objects, the tokenizer's vocabulary, the
        # app) lives as long as the server: out of the collector's sight, so a full
        # collection scans only what requests create. Without this each one took 40-300 ms
        # on the default model, a stall of every stream (docs/reliability.md).
        gc.collect()
        gc.freeze()
        config = uvicorn.Config(app, host=args.host, port=args.port,
                                log_level=args.uvicorn_log_level,
                                http=header_timeout_protocol(args.header_timeout),
                                timeout_keep_alive=args.timeout_keep_alive,
                                timeout_graceful_shutdown=5)
    except BaseException:
        engine.shutdown()     # its thread is running already
        raise
    return DrainingServer(config, lambda: drain(ctx, args.shutdown_timeout))


def print_config(args: argparse.Namespace) -> int:
    """`duet serve --print-config`: the engine's resolved configuration as JSON."""
    import json
    engine = build_engine(args)
    print(json.dumps(engine.resolved_config(), indent=1))
    return 0


def main(args: argparse.Namespace) -> int:
    if args.print_config:
        return print_config(args)
    build_server(args).run()
    return 0
