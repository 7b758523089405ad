"""`duet cluster` on a simulated two-node Ray cluster (ray.cluster_utils.Cluster: node A at
127.0.0.2 offers {"prefill": 1}, node B at 127.0.0.3 offers {"decode": 1}), its files
under a private temporary directory (RAY_TMPDIR; nothing under HOME: token auth is off,
as this process's Ray config was fixed at import and a loopback cluster needs none). Two deployments share it, each a
`duet cluster` driver process: 1 prefill + 1 decode instance (KV over Mooncake TCP from
node A to node B) and 2 colocated replicas. A replica called directly is the colocated
reference. Tests run in file order: the fault test last."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
from openai_answers import collect, normalize
from server_process import free_port

from duetserve.kv_transfer.backends import mooncake_available

ray = pytest.importorskip("ray", reason="duet cluster needs the `ray` extra")
from ray.cluster_utils import Cluster  # noqa: E402

MOONCAKE = mooncake_available()
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVE = "--num-threads 1 --max-num-seqs 1 --max-num-batched-tokens 256 --kv-cache-memory 0.25"
PROMPTS = ["The sky is", "My favourite fruit is", "Paris is the capital of",
           "Once upon a time", "The best way to learn is", "Water boils at",
           "A cat and a dog", "In the morning I"]
READY_TIMEOUT_S = 400.0     # model loads in parallel on a shared 2-core machine


class ClusterProcess:
    """A `duet cluster` driver (the router and the controller) with its output in a
    file; ready when the router's /health answers 200."""

    def __init__(self, address: str, log_dir: str, *args: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.args = ["cluster", "--ray", address, "--port", str(self.port),
                     "--health-interval", "0.5", "--serve-args", SERVE, *args]
        self.log_path = os.path.join(log_dir, f"cluster-{self.port}.log")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "duetserve", *self.args],
                                         stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"duet cluster exited with {self.proc.returncode}:\n"
                                   f"{self.log()}")
            try:
                if httpx.get(self.base + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)    # between readiness attempts only
        raise RuntimeError(f"duet cluster did not become ready:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-6000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()       # the driver kills its actors, then leaves Ray
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def instances(self) -> dict[str, dict]:
        r = httpx.get(self.base + "/cluster", timeout=10)
        assert r.status_code == 200, r.text
        return {m["name"]: m for m in r.json()["instances"]}

    def served(self) -> dict[str, float]:
        """duet_router:instance_requests_total per instance, from /metrics."""
        out = {}
        for line in httpx.get(self.base + "/metrics", timeout=10).text.splitlines():
            if line.startswith("duet_router:instance_requests_total{"):
                labels, value = line.rsplit(" ", 1)
                out[labels.split('instance="')[1].split('"')[0]] = float(value)
        return out


@pytest.fixture(scope="module")
def deployments():
    tmp = tempfile.mkdtemp(prefix="duetray-", dir="/tmp")   # short: Ray's socket paths
    env = {"RAY_TMPDIR": tmp, "RAY_AUTH_MODE": "disabled",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])),
           "RAY_USAGE_STATS_ENABLED": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)           # the Ray processes and the drivers inherit it
    cluster = None
    procs: dict[str, ClusterProcess] = {}
    try:
        t0 = time.monotonic()
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 4, "resources": {"prefill": 1}, "node_ip_address": "127.0.0.2",
            "include_dashboard": False})
        cluster.add_node(num_cpus=4, resources={"decode": 1}, node_ip_address="127.0.0.3")
        cluster.wait_for_nodes()
        print(f"\n2-node Ray cluster up in {time.monotonic() - t0:.1f} s")
        procs["rep"] = ClusterProcess(cluster.address, tmp, "--replicas", "2")
        if MOONCAKE is None:
            procs["pd"] = ClusterProcess(
                cluster.address, tmp, "--prefill", "1", "--decode", "1",
                "--prefill-resources", '{"prefill": 1}', "--decode-resources", '{"decode": 1}')
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready()
        print(f"deployments ready {time.monotonic() - t0:.1f} s after the cluster start")
        yield procs
    finally:
        for p in procs.values():
            p.stop()
        if cluster is not None:
            cluster.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        subprocess.run(["rm", "-rf", tmp], check=False)


def _body(stream: bool) -> dict:
    return {"prompt": PROMPTS, "max_tokens": 8, "temperature": 0, "logprobs": 2,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}


@pytest.fixture(scope="module")
def reference(deployments):
    """A colocated replica's answers, asked directly (not through a router)."""
    url = deployments["rep"].instances()["replica-0"]["url"]
    return {s: collect(url, _body(s)) for s in (False, True)}


@pytest.mark.skipif(MOONCAKE is not None, reason=f"Mooncake unavailable: {MOONCAKE}")
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_prefill_on_a_decode_on_b_matches_colocated(deployments, reference, stream):
    pd = deployments["pd"]
    inst = pd.instances()
    assert inst["prefill-0"]["host"] == "127.0.0.2" and inst["decode-0"]["host"] == "127.0.0.3"
    assert inst["prefill-0"]["node_id"] != inst["decode-0"]["node_id"]
    decode_url = inst["decode-0"]["url"]

    def mooncake_done() -> float:
        text = httpx.get(decode_url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("duet:kv_transfers_total{")
                   and 'backend="mooncake"' in line and 'status="done"' in line)

    before = mooncake_done()
    got = collect(pd.base, _body(stream))
    assert len(got["choices"]) == len(PROMPTS)
    assert normalize(got) == normalize(reference[stream])
    # every prompt whose first token did not end it went from node A to node B
    continuing = sum(1 for c in reference[stream]["choices"] if len(c.get("tokens") or
                     (c.get("logprobs") or {}).get("tokens") or []) > 1)
    assert mooncake_done() - before == continuing > 0


def _complete(base: str, prompt: str, max_tokens: int = 8) -> dict:
    r = httpx.post(base + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    return r.json()


def test_replicas_share_requests_and_answer_correctly(deployments, reference):
    rep = deployments["rep"]
    before = rep.served()
    answers: dict[int, dict] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(
        i, _complete(rep.base, PROMPTS[i]))) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ref = normalize(reference[False])
    for i, a in answers.items():
        assert normalize(a)[0][1:] == ref[i][1:]          # text, finish, tokens, logprobs
    after = rep.served()
    spread = {name: after[name] - before.get(name, 0) for name in after}
    assert set(spread) == {"replica-0", "replica-1"}
    assert all(n > 0 for n in spread.values()) and sum(spread.values()) == len(PROMPTS)


def _stream(base: str, prompt: str, max_tokens: int, started: threading.Event,
            out: list) -> None:
    """One streamed request; appends ("finished", completion tokens) or ("error", 0)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    outcome = ("error", 0)
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                break
            started.set()
            if chunk.get("usage"):
                outcome = ("finished", chunk["usage"]["completion_tokens"])
    out.append(outcome)


def _run_streams(base: str, n: int, max_tokens: int) -> tuple[list, list, list]:
    outcomes: list = []
    events = [threading.Event() for _ in range(n)]
    threads = [threading.Thread(target=_stream, args=(base, f"Count to {i}:", max_tokens,
                                                      events[i], outcomes))
               for i in range(n)]
    for t in threads:
        t.start()
    return threads, events, outcomes


def _until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := cond()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)
    return value


def test_scale_up_then_remove_a_replica_while_requests_run(deployments):
    """Add replica-2 at run time; then, with two streams on each replica (one running,
    one waiting: max-num-seqs 1), remove replica-1: it drains (both its streams finish),
    then its actor ends; nothing is lost."""
    rep = deployments["rep"]
    r = httpx.post(rep.base + "/cluster/instances", json={"kind": "replica"}, timeout=400)
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "replica-2" and r.json()["healthy"]
    threads, events, outcomes = _run_streams(rep.base, 6, 60)
    victim = _until(lambda: (v := rep.instances()["replica-1"])["in_flight"] == 2 and v,
                    30, "two requests on replica-1")
    assert events[0].wait(120)
    r = httpx.delete(rep.base + "/cluster/instances/replica-1", timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["drained"] is True
    for t in threads:
        t.join(120)
        assert not t.is_alive()
    assert outcomes == [("finished", 60)] * 6       # no request lost or cut
    assert set(rep.instances()) == {"replica-0", "replica-2"}
    _until(lambda: not _alive(victim["pid"]), 30, "the removed actor's process exits")
    before = rep.served()
    for p in PROMPTS[:4]:
        _complete(rep.base, p)
    after = rep.served()
    assert set(after) == {"replica-0", "replica-2"}
    assert sum(after.values()) - sum(before.values()) == 4
    r = httpx.delete(rep.base + "/cluster/instances/nope", timeout=10)
    assert r.status_code == 404


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:          # a zombie has exited
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_killed_replica_is_restarted_and_serves_again(deployments):
    """SIGKILL one replica's actor process while a stream runs on it and a non-streamed
    request waits there: the stream ends with an error event (it had started), the other
    request is retried on the other replica, nothing hangs, the router keeps serving,
    and Ray restarts the actor, which registers again (new pid and URL) and serves."""
    rep = deployments["rep"]
    victim = rep.instances()["replica-0"]
    threads, events, outcomes = _run_streams(rep.base, 2, 200)   # one per replica
    for e in events:
        assert e.wait(120)
    answers: list = []
    plain = [threading.Thread(target=lambda p=p: answers.append(_complete(rep.base, p, 16)))
             for p in PROMPTS[:2]]
    for t in plain:
        t.start()
    _until(lambda: rep.instances()["replica-0"]["in_flight"] == 2, 30,
           "a stream and a waiting request on replica-0")
    killed = time.monotonic()
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads + plain:
        t.join(120)
        assert not t.is_alive()                      # nothing hangs
    assert sorted(outcomes) == [("error", 0), ("finished", 200)]
    assert len(answers) == 2                         # retried: nothing had been sent
    _complete(rep.base, "Still serving?")             # on the other replica at once
    now = _until(lambda: (m := rep.instances()["replica-0"])["restarts"] == 1
                 and m["healthy"] and m, 300, "replica-0 restarted and healthy")
    back = time.monotonic() - killed
    assert now["pid"] != victim["pid"] and now["url"] != victim["url"]
    before = rep.served()["replica-0"]
    for p in PROMPTS[:4]:
        _complete(rep.base, p)
    assert rep.served()["replica-0"] > before         # the restarted replica serves
    print(f"\nreplica restarted and serving {back:.1f} s after SIGKILL")
