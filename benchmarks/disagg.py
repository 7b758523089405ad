"""Prefill/decode disaggregation benchmarks (docs/results.md): prints tables, writes JSON.

  1. transfer: KV of one 2,048-token prompt of the 1.5B model read by a decode instance,
     per backend (shm, Mooncake TCP), next to raw loopback TCP moving the same bytes in
     the same run; with int8 compression too (bytes and time saved).
  2. int8 accuracy: greedy continuations and top-20 logprobs of the same prompts decoded
     from uncompressed and from int8-compressed KV: token agreement and KL.
  3. serving: colocated (one instance, 2 threads) against 1P1D behind `duet router`
     (1 thread each) on a prefill-heavy workload (`duet bench serve`): TTFT and TPOT.

    python benchmarks/disagg.py --model /root/.cache/duetserve-models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
        --output-json out/disagg.json

Every instance runs in its own process on loopback; each part starts and stops its own.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

PY = sys.executable
WORDS = ("river stone light paper window garden music number silver market engine "
         "forest signal table yellow orbit").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """`python -m duetserve <args>` on a free port, ready when /health answers."""

    def __init__(self, *args: str) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([PY, "-m", "duetserve", *args, "--port", str(self.port)],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"{args[0]} exited:\n{self.log.read().decode()[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError("not ready")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def serve(model: str | None, threads: int, *extra: str) -> Proc:
    args = ["serve", "--num-threads", str(threads), "--max-num-batched-tokens", "512",
            "--kv-cache-memory", "1.0", *extra]
    return Proc(*(args + (["--model", model] if model else [])))


def metric(proc: Proc, name: str) -> float:
    total = 0.0
    for line in httpx.get(proc.base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def words_prompt(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 13 + i // 5) % len(WORDS)] for i in range(n))


def prefill(pre: Proc, prompt, max_tokens: int = 2, **extra) -> dict:
    r = httpx.post(pre.base + "/v1/completions", timeout=900, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True}, **extra})
    r.raise_for_status()
    return r.json()


def decode(dec: Proc, prompt, kv: dict, max_tokens: int = 2, **extra) -> dict:
    r = httpx.post(dec.base + "/v1/completions", timeout=900, json={
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "kv_transfer_params": {"remote_prefill": kv}, **extra})
    r.raise_for_status()
    return r.json()


class RawTCP:
    """Loopback TCP: one connection, `nbytes` sent by a thread and received into a
    preallocated buffer (the best case for a byte stream). `once()` times one transfer,
    so that raw TCP can be measured right after each KV read, under the same load."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(1)
        payload = memoryview(bytearray(os.urandom(1 << 20)) * (nbytes // (1 << 20) + 1))[:nbytes]
        self.sink = memoryview(bytearray(nbytes))

        def sender() -> None:
            conn, _ = self.srv.accept()
            with conn:
                while conn.recv(1):
                    conn.sendall(payload)
        self.thread = threading.Thread(target=sender, daemon=True)
        self.thread.start()
        self.conn = socket.create_connection(self.srv.getsockname())

    def once(self) -> float:
        t0 = time.perf_counter()
        self.conn.sendall(b"x")
        got = 0
        while got < self.nbytes:
            got += self.conn.recv_into(self.sink[got:], self.nbytes - got)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.conn.close()
        self.thread.join(10)
        self.srv.close()


def part_transfer(model: str | None, prompt_tokens: int, repeats: int) -> dict:
    """One prefill per compression mode, read once (warm-up) then `repeats` times by
    each backend (the blocks stay held: no release_url, a long timeout). Each read is followed by one raw
    TCP transfer of the uncompressed KV's bytes: machine load hits both alike."""
    result: dict = {"prompt_tokens": prompt_tokens, "backends": {}}
    raw_secs: list[float] = []
    raw = None
    # no prefix caching: each repeat reads every block again
    decs = {"shm": serve(model, 1, "--role", "decode", "--no-prefix-caching"),
            "mooncake": serve(model, 1, "--role", "decode", "--no-prefix-caching",
                              "--kv-transfer-backend", "mooncake")}
    try:
        for compression in ("none", "int8"):
            pre = serve(model, 2, "--role", "prefill", "--kv-transfer-timeout", "1800",
                        "--kv-transfer-compression", compression)
            try:
                prompt = list(range(1000, 1000 + prompt_tokens))     # token ids
                kv = prefill(pre, prompt)["kv_transfer_params"]
                for name, dec in decs.items():
                    decode(dec, prompt, kv)      # warm-up: Mooncake's connection set-up
                    secs, nbytes = [], 0
                    for _ in range(repeats):
                        b0, s0 = (metric(dec, "duet:kv_transfer_bytes_total"),
                                  metric(dec, "duet:kv_transfer_time_seconds_total"))
                        decode(dec, prompt, kv)
                        nbytes = metric(dec, "duet:kv_transfer_bytes_total") - b0
                        secs.append(metric(dec, "duet:kv_transfer_time_seconds_total") - s0)
                        if raw is None:      # the first read tells the uncompressed size
                            raw = RawTCP(int(nbytes))
                        raw_secs.append(raw.once())
                    result["backends"][f"{name}/{compression}"] = {
                        "bytes": int(nbytes), "seconds": secs,
                        "median_s": statistics.median(secs),
                        "gb_per_s": nbytes / statistics.median(secs) / 1e9}
            finally:
                pre.close()
        result["raw_tcp"] = {"bytes": raw.nbytes, "seconds": raw_secs,
                             "median_s": statistics.median(raw_secs),
                             "gb_per_s": raw.nbytes / statistics.median(raw_secs) / 1e9}
    finally:
        if raw is not None:
            raw.close()
        for d in decs.values():
            d.close()
    return result


# Natural text (the word lists above make many near ties: a greedy output flips on tiny
# perturbations there, so both kinds of prompt are reported).
TEXTS = [
    "The old lighthouse stood at the edge of the cliff for more than a century. Every "
    "night the keeper climbed the spiral stairs, trimmed the wick and watched the ships "
    "pass in the dark. One winter evening, a storm rolled in from the north and",
    "To make a simple loaf of bread, mix flour, water, salt and a little yeast in a large "
    "bowl. Knead the dough for ten minutes until it is smooth, then cover it and let it "
    "rise in a warm place. After about an hour,",
    "Photosynthesis is the process by which green plants use sunlight to turn water and "
    "carbon dioxide into sugar and oxygen. It takes place mostly in the leaves, inside "
    "small structures called chloroplasts. The first stage of the process",
    "The train left the station at half past seven, crowded with people going to work. "
    "Anna found a seat by the window and opened the letter she had received the day "
    "before. She read the first line twice, because she could not believe that",
    "When you learn a new programming language, it helps to start with small programs. "
    "Write a function that adds two numbers, then one that reverses a string, then one "
    "that reads a file line by line. Each small step teaches you",
    "The city council met on Tuesday to discuss the new park on the east side of town. "
    "Several residents spoke in favour of the plan, pointing out that children had no "
    "safe place to play. Others worried about the cost, and",
    "Mountains are formed over millions of years as the plates of the earth's crust push "
    "against each other. Where two plates meet, the rock is folded and lifted, and over "
    "time wind and water carve it into peaks and valleys. The highest mountains",
    "My grandmother kept a small garden behind her house, with tomatoes, beans and a row "
    "of sunflowers along the fence. Every summer I spent a few weeks with her, and each "
    "morning we went out together to",
]


def _kl_top(p: dict[str, float], q: dict[str, float]) -> float:
    """KL(p || q) over p's top tokens, both renormalised on that set (0 iff they agree
    there); a token missing from q's list gets q's smallest listed logprob (an upper
    bound on its probability)."""
    floor = min(q.values())
    qs = {t: q.get(t, floor) for t in p}
    zp = math.log(sum(math.exp(v) for v in p.values()))
    zq = math.log(sum(math.exp(v) for v in qs.values()))
    return sum(math.exp(lp - zp) * ((lp - zp) - (qs[t] - zq)) for t, lp in p.items())


def compare_runs(ref: list[dict], other: list[dict]) -> dict:
    """Greedy agreement and KL of `other` against `ref` (logprobs of each output):
    tokens before the first divergence, identical outputs, per-position KL before the
    divergence (the first token comes from the prefill: no int8 involved, skipped),
    and the reference's top-1 - top-2 logprob margin where each output diverges."""
    same_tokens = total = identical = 0
    kls: list[float] = []
    margins: list[float] = []
    for a, b in zip(ref, other):
        ta, tb = a["tokens"], b["tokens"]
        total += len(ta)
        diverged = False
        for k, (x, y) in enumerate(zip(ta, tb)):
            if x != y:
                diverged = True
                top = sorted(a["top_logprobs"][k].values(), reverse=True)
                margins.append(top[0] - top[1])
                break
            same_tokens += 1
            if k > 0:
                kls.append(_kl_top(a["top_logprobs"][k], b["top_logprobs"][k]))
        identical += not diverged and len(ta) == len(tb)
    return {"tokens_before_first_divergence": same_tokens, "tokens": total,
            "agreement": same_tokens / max(total, 1), "identical_outputs": identical,
            "outputs": len(ref), "kl_mean": statistics.fmean(kls) if kls else None,
            "kl_max": max(kls) if kls else None, "kl_positions": len(kls),
            "divergence_margins": margins}


def part_accuracy(model: str | None, num_prompts: int, prompt_words: int,
                  max_tokens: int) -> dict:
    """Each prompt prefilled by an uncompressed and by an int8 prefill instance and
    decoded by the same decode instance; "none_again" (a second uncompressed run)
    checks that the comparison itself is exact."""
    prompts = {"words": [words_prompt(prompt_words, i) for i in range(num_prompts)],
               "text": TEXTS[:num_prompts]}
    dec = serve(model, 1, "--role", "decode", "--no-prefix-caching")
    runs: dict[str, dict[str, list]] = {}
    try:
        for mode in ("none", "none_again", "int8"):
            compression = "int8" if mode == "int8" else "none"
            pre = serve(model, 1, "--role", "prefill", "--kv-transfer-compression", compression)
            try:
                for kind, texts in prompts.items():
                    outs = runs.setdefault(mode, {}).setdefault(kind, [])
                    for prompt in texts:
                        kv = prefill(pre, prompt, max_tokens, logprobs=20)["kv_transfer_params"]
                        kv["release_url"] = pre.base + "/kv/release"
                        outs.append(decode(dec, prompt, kv, max_tokens,
                                           logprobs=20)["choices"][0]["logprobs"])
            finally:
                pre.close()
    finally:
        dec.close()
    return {"max_tokens": max_tokens, "prompt_words": prompt_words,
            **{f"{mode}/{kind}": compare_runs(runs["none"][kind], runs[mode][kind])
               for mode in ("none_again", "int8") for kind in prompts}}


def bench_serve(base: str, label: str, args: argparse.Namespace, out_dir: str) -> dict:
    path = os.path.join(out_dir, f"{label}.json")
    cmd = [PY, "-m", "duetserve", "bench", "serve", "--base-url", base, "--no-progress",
           "--num-prompts", str(args.serve_prompts), "--request-rate", str(args.serve_rate),
           "--input-len", str(args.serve_input_len), "--output-len", str(args.serve_output_len),
           "--ignore-eos", "--no-continuous-usage", "--percentiles", "50,99",
           "--label", label, "--output-json", path, "--seed", "1"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        summary = json.load(f)["runs"][0]["summary"]
    return {k: summary[k] for k in ("ttft_ms", "tpot_ms", "e2el_ms", "completed",
                                     "duration") if k in summary}


def part_serving(model: str | None, args: argparse.Namespace) -> dict:
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        colo = serve(model, 2)
        try:
            out["colocated_2t"] = bench_serve(colo.base, "colocated", args, tmp)
        finally:
            colo.close()
        pre = serve(model, 1, "--role", "prefill")
        dec = serve(model, 1, "--role", "decode")
        router = Proc("router", "--prefill", pre.base, "--decode", dec.base)
        try:
            out["1p1d_1t_each"] = bench_serve(router.base, "1p1d", args, tmp)
        finally:
            for p in (router, dec, pre):
                p.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="GGUF for the transfer part (default model "
                   "otherwise); accuracy and serving use --small-model")
    p.add_argument("--small-model", default=None, help="model for accuracy and serving "
                   "(default: the default model)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--accuracy-prompts", type=int, default=8)
    p.add_argument("--serve-prompts", type=int, default=24)
    p.add_argument("--serve-rate", type=float, default=1.0)
    p.add_argument("--serve-input-len", default="1024")
    p.add_argument("--serve-output-len", default="48")
    p.add_argument("--parts", default="transfer,accuracy,serving")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    parts = set(args.parts.split(","))
    result: dict = {"args": vars(args)}
    if "transfer" in parts:
        t = result["transfer"] = part_transfer(args.model, args.prompt_tokens, args.repeats)
        raw = t["raw_tcp"]
        print(f"\nKV transfer, {t['prompt_tokens']}-token prompt ({args.model or 'default model'})")
        print(f"{'path':<16}{'MB':>10}{'median ms':>12}{'GB/s':>8}{'x raw TCP':>11}")
        for name, r in [*t["backends"].items(), ("raw tcp", raw)]:
            print(f"{name:<16}{r['bytes'] / 1e6:>10.1f}{r['median_s'] * 1e3:>12.1f}"
                  f"{r['gb_per_s']:>8.2f}{r['gb_per_s'] / raw['gb_per_s']:>11.2f}")
    if "accuracy" in parts:
        a = result["accuracy"] = part_accuracy(args.small_model, args.accuracy_prompts, 48, 32)
        print(f"\nint8 KV transfer vs uncompressed ({args.small_model or 'default model'}), "
              f"{a['max_tokens']} greedy tokens per prompt")
        for name, r in a.items():
            if not isinstance(r, dict):
                continue
            kl = "-" if r["kl_mean"] is None else f"{r['kl_mean']:.2e} / {r['kl_max']:.2e}"
            print(f"{name:<18} {r['tokens_before_first_divergence']}/{r['tokens']} tokens "
                  f"before the first divergence, {r['identical_outputs']}/{r['outputs']} "
                  f"identical; top-20 KL mean / max {kl} over {r['kl_positions']} "
                  f"positions; margins at divergence "
                  f"{[round(m, 3) for m in r['divergence_margins']]}")
    if "serving" in parts:
        s = result["serving"] = part_serving(args.small_model, args)
        print(f"\nServing, {args.serve_prompts} requests at {args.serve_rate}/s, input "
              f"{args.serve_input_len}, output {args.serve_output_len} "
              f"({args.small_model or 'default model'})")
        print(f"{'setup':<16}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}")
        for name, r in s.items():
            tt, tp = r["ttft_ms"], r["tpot_ms"]
            print(f"{name:<16}{tt['median']:>10.1f}{tt['p99']:>10.1f}{tp['median']:>10.1f}"
                  f"{tp['p99']:>10.1f}")
    if args.output_json:
        os.makedirs(os.path.dirname(os.path.abspath(args.output_json)), exist_ok=True)
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
