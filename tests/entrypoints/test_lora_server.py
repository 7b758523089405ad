"""LoRA adapters through the server: `model` selects an adapter by name, /v1/models lists
them under the base, runtime load and unload (vLLM's endpoints) behind the API key, and
OpenAI-style errors for unknown names and bad adapters. One tiny-model server for the
module; the expected texts come from the offline engine on the same adapters (whose
tokens tests/engine/test_lora_engine.py checks against the merged references)."""
from __future__ import annotations

import httpx
import pytest

from lora_helpers import make_adapter
from server_process import ServerProcess
from tiny_models import make_tiny_checkpoint
from duetserve.request import LoRARequest
from duetserve.sampling_params import SamplingParams

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 17, 99, 3, 250, 42, 42, 7]
N = 8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_server")
    base = make_tiny_checkpoint(str(root / "base"), "llama-gqa-untied")
    a = make_adapter(base, str(root / "a"), seed=21)
    b = make_adapter(base, str(root / "b"), seed=22, r=8)
    with ServerProcess("--model", base, "--api-key", KEY, "--max-loras", "2",
                       "--lora-modules", f"alpha={a}") as srv:
        yield srv, base, a, b


@pytest.fixture(scope="module")
def expected(setup):
    """Offline texts of PROMPT: the base, adapter a, adapter b (greedy)."""
    from duetserve.engine.llm import LLM
    _, base, a, b = setup
    llm = LLM(base, num_threads=2, max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=N, ignore_eos=True)
    return [llm.generate(PROMPT, params, lora_request=lora)[0].outputs[0].text
            for lora in (None, LoRARequest("a", 1, a), LoRARequest("b", 2, b))]


def _complete(srv, model: str) -> httpx.Response:
    return httpx.post(f"{srv.base}/v1/completions", headers=AUTH, timeout=60, json={
        "model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
        "ignore_eos": True})


def _models(srv) -> dict[str, dict]:
    data = httpx.get(f"{srv.base}/v1/models", headers=AUTH).json()["data"]
    return {m["id"]: m for m in data}


def test_model_selects_the_adapter(setup, expected):
    srv, base, a, _ = setup
    models = _models(srv)
    assert set(models) == {"base", "alpha"}
    assert models["alpha"]["parent"] == "base" and models["base"]["parent"] is None
    assert models["alpha"]["root"] == a
    texts = [_complete(srv, m).json()["choices"][0]["text"] for m in ("base", "alpha")]
    assert texts == expected[:2] and texts[0] != texts[1]
    r = _complete(srv, "nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["param"] == "model" and "`nope` does not exist" in err["message"]
    assert "`alpha`" in err["message"]


def test_load_and_unload_at_run_time(setup, expected, tmp_path):
    srv, _, a, b = setup
    load, unload = f"{srv.base}/v1/load_lora_adapter", f"{srv.base}/v1/unload_lora_adapter"
    body = {"lora_name": "beta", "lora_path": b}
    assert httpx.post(load, json=body).status_code == 401            # behind the API key
    r = httpx.post(load, json=body, headers=AUTH)
    assert r.status_code == 200 and "beta" in r.text
    assert _models(srv)["beta"]["parent"] == "base"
    assert _complete(srv, "beta").json()["choices"][0]["text"] == expected[2]
    assert _complete(srv, "alpha").json()["choices"][0]["text"] == expected[1]
    r = httpx.post(load, json=body, headers=AUTH)                     # the name is taken
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_name"
    assert "already been loaded" in r.json()["error"]["message"]
    r = httpx.post(load, json={"lora_name": "gamma", "lora_path": str(tmp_path / "x")},
                   headers=AUTH)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"
    assert "is not a folder" in r.json()["error"]["message"]
    r = httpx.post(load, json={"lora_name": "gamma"}, headers=AUTH)
    assert r.status_code == 400 and "lora_path" in r.json()["error"]["message"]
    r = httpx.post(unload, json={"lora_name": "beta"}, headers=AUTH)
    assert r.status_code == 200 and "beta" in r.text
    assert "beta" not in _models(srv)
    assert _complete(srv, "beta").status_code == 404
    r = httpx.post(unload, json={"lora_name": "beta"}, headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


def test_bad_lora_modules_stop_start_up(setup, tmp_path):
    """A bad --lora-modules item is a one-line error before the server listens."""
    import argparse

    from duetserve.entrypoints.cli import UserError
    from duetserve.entrypoints.openai import serve
    _, base, a, _ = setup
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    cases = [([f"alpha{a}"], "lora_modules: expected name=PATH, got 'alpha"),
             ([f"x={tmp_path / 'none'}"], "--lora-modules: LoRA adapter .* is not a folder"),
             ([f"base={a}"], "'base' is the base model's name")]
    for modules, match in cases:
        args = p.parse_args(["--model", base, "--port", "0", "--num-threads", "2",
                             "--max-num-batched-tokens", "256", "--lora-modules", *modules])
        with pytest.raises(UserError, match=match):
            serve.build_server(args)


def test_metrics_per_adapter(setup, expected):
    """/metrics counts each adapter's ended requests and their tokens (label lora_name),
    the adapters resident and the loads."""
    srv, _, a, b = setup
    load = f"{srv.base}/v1/load_lora_adapter"
    before = srv.metrics(AUTH)
    for name, path in (("m1", b), ("m2", a)):
        r = httpx.post(load, json={"lora_name": name, "lora_path": path}, headers=AUTH)
        assert r.status_code == 200, r.text
    texts = [_complete(srv, m).json()["choices"][0]["text"] for m in ("m1", "m2", "m2")]
    assert texts == [expected[2], expected[1], expected[1]]
    after = srv.metrics(AUTH)

    def per_adapter(series: str, name: str) -> float:
        return after[f'duet:lora_{series}_total{{lora_name="{name}",model_name="base"}}']

    assert [per_adapter("requests", n) for n in ("m1", "m2")] == [1, 2]
    assert [per_adapter("prompt_tokens", n) for n in ("m1", "m2")] == \
        [len(PROMPT), 2 * len(PROMPT)]
    assert [per_adapter("generation_tokens", n) for n in ("m1", "m2")] == [N, 2 * N]
    assert not any('lora_name="base"' in k for k in after)   # the base has no series
    # --max-loras 2: both resident now, each read once (m2's second request found it)
    assert after["duet:lora_resident_adapters"] == 2
    assert after["duet:lora_loads_total"] - before.get("duet:lora_loads_total", 0) == 2


def test_load_and_unload_under_load(setup, expected):
    """In process, --max-loras 2: while a base request and two adapters' requests run,
    adapter `z` is loaded by POST and used (it waits for a slot), and `x` is unloaded
    while its request runs (the engine is held inside a step to make sure of it). As
    vLLM: the unload answers at once, new requests for `x` get 404, the running one
    finishes under `x`, whose weights are freed when it ends. No request fails (each
    text equals the offline engine's), every KV block is free, no slot holds `x`."""
    import argparse
    import asyncio
    import threading

    from duetserve.entrypoints.openai import serve
    _, base, a, b = setup
    want = {"base": expected[0], "x": expected[1], "y": expected[2], "z": expected[1]}
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    args = p.parse_args([base, "--num-threads", "2", "--max-num-batched-tokens", "64",
                         "--max-loras", "2", "--lora-modules", f"x={a}", f"y={b}"])
    app = serve.build_server(args).config.app
    engine, loras = app.state.ctx.engine, app.state.ctx.loras
    core, x_id = engine.engine, loras.get("x").lora_int_id
    held, resume = threading.Event(), threading.Event()

    def hold_once(_stats) -> None:     # engine thread: pause once x's request has a token
        if not held.is_set() and any(r.lora_request and r.lora_request.lora_name == "x"
                                     and r.num_output_tokens > 0
                                     for r in core.scheduler.running):
            held.set()
            assert resume.wait(60)
    core.add_step_observer(hold_once)

    async def scenario() -> dict:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                     timeout=120) as c:
            async def complete(model: str) -> str:
                r = await c.post("/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": N, "temperature": 0,
                    "ignore_eos": True})
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            running = [asyncio.create_task(complete(m)) for m in ("base", "x", "y")]
            assert await asyncio.to_thread(held.wait, 60)     # x's request is running
            r = await c.post("/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": a})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/unload_lora_adapter", json={"lora_name": "x"})
            assert r.status_code == 200, r.text
            r = await c.post("/v1/completions", json={"model": "x", "prompt": PROMPT})
            assert r.status_code == 404
            resume.set()
            z = await complete("z")
            texts = dict(zip(("base", "x", "y"), await asyncio.gather(*running)))
            return {**texts, "z": z}

    try:
        texts = asyncio.run(scenario())
    finally:
        resume.set()
        engine.shutdown()
    assert texts == want
    assert engine.num_step_errors == 0 and core.executor.num_isolations == 0
    assert core.scheduler.kv_cache_manager.num_used_blocks == 0
    assert set(loras.names()) == {"y", "z"}
    slots, z_id = core.runner.lora, loras.get("z").lora_int_id
    assert x_id not in slots.resident() and z_id in slots.resident()   # y: evicted or not
    assert sum(w is not None for w in slots.adapters) == len(slots.resident())
    assert not core._lora_unloaded and not slots._reading and not slots._read
