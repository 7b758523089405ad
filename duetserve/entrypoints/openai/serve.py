"""`duet serve [MODEL]`: the OpenAI-compatible HTTP server.

    duet serve                                  # default model on 127.0.0.1:8000
    duet serve ./my-model.gguf --port 9000 --api-key secret
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The sky is", "max_tokens": 16}'
"""
from __future__ import annotations

import argparse
import logging
import os

from duetserve.entrypoints.cli import UserError
from duetserve.entrypoints.engine_args import add_engine_arguments, build_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_engine_arguments(p, positional_model=True)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="bind address (default %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    s.add_argument("--served-model-name", default=None,
                   help="model name in the API (default: the checkpoint's file/folder stem)")
    s.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` (default: env DUET_API_KEY)")
    s.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])


def served_name(model_arg: str | None) -> tuple[str, str]:
    """(served model name, resolved checkpoint path) of the --model/MODEL argument."""
    from duetserve.loader import resolve_model_path
    path = resolve_model_path(model_arg)
    base = os.path.basename(os.path.normpath(path))
    stem = base if os.path.isdir(path) else os.path.splitext(base)[0]
    return stem, path


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from duetserve.engine.async_engine import AsyncEngine
    from duetserve.entrypoints.openai.api_server import build_app

    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be in [0, 65535], got {args.port}")
    core = build_engine(args)
    name, path = served_name(getattr(args, "model_pos", None) or args.model)
    name = args.served_model_name or name
    api_key = args.api_key or os.environ.get("DUET_API_KEY") or None
    logging.getLogger("duetserve.metrics").setLevel(logging.INFO)
    logging.getLogger("duetserve.serve").setLevel(logging.INFO)
    if not logging.getLogger().handlers:
        logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(AsyncEngine(core), name, api_key, path)
    logging.getLogger("duetserve.serve").info(
        "serving %s at http://%s:%d/v1 (max_model_len %d%s)", name, args.host, args.port,
        core.max_model_len, ", API key required" if api_key else "")
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                timeout_graceful_shutdown=5)
    return 0
