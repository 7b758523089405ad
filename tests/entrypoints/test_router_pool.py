"""The router's pool as `duet cluster` changes it at run time (no servers): registration
checks, draining instances get no new requests, a moved instance is out until checked,
per-instance counts."""
from __future__ import annotations

import subprocess
import sys

import pytest

from duetserve.entrypoints.router.policy import NoInstanceError, Policy
from duetserve.entrypoints.router.pool import Instance, InstancePool


def test_registration_rules():
    pool = InstancePool([Instance("http://a:1", "replica", name="replica-0")], colocated=True)
    with pytest.raises(ValueError, match="takes replica instances, not decode"):
        pool.add(Instance("http://b:1", "decode"))
    with pytest.raises(ValueError, match="already registered"):
        pool.add(Instance("http://c:1", "replica", name="replica-0"))
    with pytest.raises(ValueError, match="already registered"):
        pool.add(Instance("http://a:1", "replica", name="replica-9"))
    with pytest.raises(ValueError, match="kind must be one of"):
        Instance("http://d:1", "both")
    pd = InstancePool([Instance("http://p:1", "prefill")], colocated=False)
    assert not pd.ready()                           # no decode instance yet
    pd.add(Instance("http://d:1", "decode"))
    assert pd.ready() and [i.name for i in pd.all] == ["http://p:1", "http://d:1"]


def test_draining_and_moved_instances_get_no_requests():
    a, b = Instance("http://a:1", "replica", name="r0"), Instance("http://b:1", "replica",
                                                                  name="r1")
    pool = InstancePool([a, b], colocated=True)
    policy = Policy("round_robin")
    assert {policy.pick(pool.replica).name for _ in range(4)} == {"r0", "r1"}
    b.draining = True
    assert {policy.pick(pool.replica).name for _ in range(4)} == {"r0"}
    a.move("http://a:2", "restarted")
    assert a.url == "http://a:2" and not a.healthy and a.load == {}
    with pytest.raises(NoInstanceError):
        policy.pick(pool.replica)
    assert not pool.ready()
    a.mark_up()
    assert pool.ready()
    pool.remove(b)
    assert pool.get("r1") is None and pool.get("r0") is a


def test_begin_end_count_requests():
    a = Instance("http://a:1", "replica")
    a.begin()
    a.begin()
    a.end()
    assert (a.in_flight, a.served) == (1, 2)


@pytest.mark.parametrize("argv, message", [
    (["router", "--replica", "http://a:1", "--prefill", "http://b:1"], "not both kinds"),
    (["router", "--prefill", "http://b:1"], "go together"),
    (["router", "--replica", "http://a:1", "--upstream-read-timeout", "0"],
     "--upstream-read-timeout must be > 0"),
    (["cluster", "--replicas", "1", "--upstream-connect-timeout", "-1"],
     "--upstream-connect-timeout must be > 0"),
    (["cluster", "--replicas", "0"], "--replicas must be >= 1"),
    (["cluster", "--replicas", "1", "--prefill", "1"], "give --replicas N, or"),
    (["cluster", "--replicas", "1", "--serve-args", "--port 9"], "set by the cluster"),
    (["cluster", "--prefill", "1", "--decode", "1", "--decode-resources", "[1]"],
     "must be a JSON object"),
])
def test_bad_flags_are_one_line_errors(argv, message, capsys):
    """Checked before anything starts (no server, no Ray); in this process, as `duet`'s
    main() (the subprocess path, `python -m duetserve`, is the next test's)."""
    from duetserve.entrypoints.cli import main
    try:
        rc = main(argv)
    except SystemExit as e:          # argparse's own usage errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 or err.startswith("usage:"), err


def test_a_bad_flag_exits_2_from_the_command_line():
    r = subprocess.run([sys.executable, "-m", "duetserve", "cluster", "--replicas", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--replicas must be >= 1" in r.stderr, r.stderr


def test_a_late_health_answer_is_not_a_dead_instance():
    """One timed-out /health leaves an instance in; TIMEOUTS_DOWN in a row take it out;
    a refused connection takes it out at once; an answer puts it back."""
    import asyncio

    import httpx

    from duetserve.entrypoints.router.pool import TIMEOUTS_DOWN

    mode = {"a": "timeout"}

    def handler(request: httpx.Request) -> httpx.Response:
        how = mode[request.url.host]
        if how == "timeout":
            raise httpx.ReadTimeout("late", request=request)
        if how == "refused":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"num_waiting": 0})

    async def run() -> None:
        a = Instance("http://a:1", "replica")
        pool = InstancePool([a], colocated=True)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            for n in range(1, TIMEOUTS_DOWN):
                await pool.check(client, a)
                assert a.healthy and a.timeouts == n
            await pool.check(client, a)
            assert not a.healthy and "timed out" in a.last_error
            mode["a"] = "ok"
            await pool.check(client, a)
            assert a.healthy and a.timeouts == 0
            mode["a"] = "refused"
            await pool.check(client, a)
            assert not a.healthy and "ConnectError" in a.last_error

    asyncio.run(run())


def test_router_drops_idle_connections_before_an_instance_closes_them():
    """The router's client must not keep an idle connection as long as the instance does
    (`duet serve --timeout-keep-alive`): reusing one the instance is closing at that
    moment fails the request with ReadError."""
    import argparse

    from duetserve.entrypoints.openai import serve
    from duetserve.entrypoints.router import app

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    assert 0 < app.KEEPALIVE_EXPIRY_S < p.get_default("timeout_keep_alive")
