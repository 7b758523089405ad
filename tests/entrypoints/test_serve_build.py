"""`duet serve` builds its engine on the thread that steps it (AsyncEngine.build): loading
on the main thread and stepping on another doubled batch-1 decode time (two OpenMP pools,
see duetserve/engine/async_engine.py)."""
from __future__ import annotations

import argparse
import threading

from duetserve.entrypoints.openai import serve


def test_serve_builds_the_engine_on_the_engine_thread(tiny_checkpoints, monkeypatch) -> None:
    built_on: list[threading.Thread] = []
    real = serve.build_engine

    def recording_build_engine(*a, **kw):
        built_on.append(threading.current_thread())
        return real(*a, **kw)

    monkeypatch.setattr(serve, "build_engine", recording_build_engine)
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args([tiny_checkpoints["llama-gqa-tied"], "--port", "0", "--num-threads", "2",
                         "--max-num-batched-tokens", "256"])
    server = serve.build_server(args)
    engine = server.config.app.state.ctx.engine
    try:
        assert built_on == [engine._thread] and engine.is_running
        assert built_on[0] is not threading.current_thread()
    finally:
        engine.shutdown()
    assert not engine.is_running
