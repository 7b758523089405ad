"""`duet router`: the OpenAI API in front of prefill and decode instances.

    pool.py      instances, health checks (out when failing, back when answering)
    policy.py    round robin, least loaded, prefix-aware (prefill)
    flow.py      one sample of one prompt: prefill -> (first token) -> decode, failover
    merge.py     n samples x prompts merged into one OpenAI response or SSE stream
    proxy.py     colocated replicas: a request whole to one, failover, relay
    upstream.py  every call to an instance: the failover loop, timeouts, error bodies
    app.py       the FastAPI app and `duet router`'s arguments

It talks HTTP only and imports no torch, the engine or the models.
"""
