"""Start `python -m duetserve serve` in a subprocess on a free loopback port and wait
until /health answers (bounded readiness loop of short HTTP attempts). Every server checks
its scheduler's integrity when idle, and schedules with the pinned step time unless the
test fixes the budget itself (tests/pinned.py).

The kernel choices a model's load measures (models/kernels.py) are measured once, in the
test process, before its first server starts: servers started side by side would each
measure them, and two measurements on a busy machine can disagree (say on the row count
where the low-bit kernels end), so two servers of one test could round differently."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
from pinned import pinned_step_time

READY_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_WARMED: set[tuple] = set()


def warm_kernel_cache(args: list[str]) -> None:
    """Load the model a `duet serve` command line serves once in this process, with its
    dtype, quantization and thread count (all part of the measurements' keys), so the
    session's kernel measurements are cached before any such server reads them."""
    import argparse

    import torch

    from duetserve.entrypoints.openai import serve
    from duetserve.loader import load_model
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    ns = parser.parse_args(args[1:])
    key = (ns.model_pos or ns.model, ns.dtype, ns.quantization, ns.num_threads or 2)
    if key in _WARMED:
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(key[3])
    try:
        load_model(key[0], key[1], quantization=key[2])
    finally:
        torch.set_num_threads(threads)
    _WARMED.add(key)


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        pin = [] if {"--max-num-batched-tokens", "--step-time"} & set(args) else \
            ["--step-time", pinned_step_time()]
        self.args = ["serve", "--port", str(self.port), "--num-threads", "2",
                     "--check-integrity-when-idle", *pin, *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        return self.start().wait_ready()

    def start(self) -> "ServerProcess":
        """Start the process without waiting (several servers start side by side, then
        each wait_ready())."""
        if self.args[0] == "serve":
            warm_kernel_cache(self.args)
        self.proc = subprocess.Popen([sys.executable, "-m", "duetserve", *self.args],
                                     env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        return self

    def wait_ready(self) -> "ServerProcess":
        """Until /health answers 200 (RuntimeError with its output if the process exits,
        or after READY_TIMEOUT_S, when it is stopped)."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   f"{self.proc.stdout.read()}")
            try:
                if httpx.get(f"{self.base}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)    # between readiness attempts only
        self.__exit__()
        raise RuntimeError("server did not become ready")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def metrics(self, headers: dict | None = None) -> dict[str, float]:
        """Samples of /metrics as {"name{labels}": value} plus {"name": sum over labels}."""
        text = httpx.get(f"{self.base}/metrics", headers=headers, timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
            name = key.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out
