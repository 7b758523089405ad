"""Flags that more than one `duet` command declares, declared once: where a server binds
(`duet serve`, `duet router`, `duet cluster`) and how KV crosses instances (`duet serve`,
`duet cluster`). Light: only torch-free kv_transfer.config is imported."""
from __future__ import annotations

import argparse

from duetserve.kv_transfer.config import BACKENDS


def add_bind_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup, port: int,
                       what: str) -> None:
    """--host (default 127.0.0.1) and --port (default `port`) of the `what` it serves.
    Mutates `p`."""
    p.add_argument("--host", default="127.0.0.1",
                   help=f"{what} bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=port, help=f"{what} port (default %(default)s)")


def add_kv_backend_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup,
                            default: str, help_text: str) -> None:
    """--kv-transfer-backend, one of kv_transfer.config.BACKENDS. Mutates `p`."""
    p.add_argument("--kv-transfer-backend", default=default, choices=list(BACKENDS),
                   help=f"{help_text} (default %(default)s)")
