"""--api-key: /v1 needs `Authorization: Bearer <key>` (401 otherwise); /health stays open.
The key comes from DUET_API_KEY here (the env fallback of --api-key)."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_process import ServerProcess


def test_api_key() -> None:
    with ServerProcess(env={"DUET_API_KEY": "sekrit"}) as srv:
        assert httpx.get(f"{srv.base}/health").status_code == 200
        r = httpx.get(f"{srv.base}/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=f"{srv.base}/v1", api_key=key or "x",
                                max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model="m", prompt="Hi", max_tokens=1)
        good = openai.OpenAI(base_url=f"{srv.base}/v1", api_key="sekrit", max_retries=0)
        model = good.models.list().data[0].id
        r = good.completions.create(model=model, prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens == 2 or r.choices[0].finish_reason == "stop"
