"""A peer in `make bench-scale`'s run: vLLM's Rust router (`vllm-router`, PyPI, in a virtualenv of
its own: scripts/peer_venvs.sh) in front of W mock OpenAI workers on this host, fed the same
trace's prompts as the router under test.

    python -m bench.scale.peer [--workers 4,256] [--rates 100,1000] [--policies cache_aware,round_robin]

The mock workers (one process, a port each: `python -m bench.scale.peer serve`) answer every
completion at once with one token, so what a request waits beyond a direct call is the router's.
For each (policy, W, rate): an idle window (vllm-router's own background rate: health checks),
then Poisson arrivals of the trace's prompts (as text: a block of token ids stays a block of
words, so prompts sharing blocks share a prefix) sent open loop through vllm-router, then the
same arrivals sent straight to the workers (round robin). Added latency: p50 through the router
less p50 direct (p99 the same); CPU per request: vllm-router's CPU over the arrivals less its idle
rate, per request answered. Cores as bench-scale pins them: the router on the first half, the
workers and the driver on the other.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from bench.scale.meters import cpu_s
from bench.scale.pin import pin
from bench.scale.plan import Probe, read_trace
from bench.scale.report import percentiles
from pdserve.local.servers import free_port
from pdserve.planner.arrivals import arrival_times

PEERS = Path(os.environ.get("PD_PEERS_DIR", Path.home() / ".cache" / "pdserve" / "peers"))
BINARY = PEERS / "vllm-router" / "bin" / "vllm-router"
MODEL = "mock"
TIMEOUT_S = 10.0
IDLE_S = 2.0
POLICIES = ("cache_aware", "round_robin")
COMPLETION = {"id": "cmpl-0", "object": "text_completion", "created": 0, "model": MODEL,
              "choices": [{"index": 0, "text": " a", "finish_reason": "length", "logprobs": None}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


def text(probe: Probe) -> str:
    return " ".join(map(str, probe.tokens))


# -- the mock workers ------------------------------------------------------------------------
async def serve_mocks(ports: list[int]) -> None:
    """An OpenAI-shaped worker on each port: /v1/completions answered at once, /health, /v1/models."""
    body = json.dumps(COMPLETION).encode()
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "mock"}]}).encode()

    async def completion(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def listed(_: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/completions", completion)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", listed)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)   # until told (or EOF)
    await runner.cleanup()


# -- the driver ------------------------------------------------------------------------------
async def send(session: aiohttp.ClientSession, url: str, prompt: str, due: float) -> float | None:
    """Seconds from send to the whole answer; None when it failed or timed out."""
    delay = due - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    sent = time.perf_counter()
    try:
        async with session.post(url, json={"model": MODEL, "prompt": prompt, "max_tokens": 1}) as r:
            await r.read()
            return time.perf_counter() - sent if r.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def drive(urls: list[str], prompts: list[str], rate: float, seconds: float, seed: int = 0) -> list[float | None]:
    """Open-loop Poisson arrivals over `seconds`, the prompts in order, the urls in turn."""
    times = [t for t in arrival_times(int(1.5 * rate * seconds) + 10, rate, seed=seed) if t < seconds]
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as s:
        start = time.perf_counter() + 0.05
        return await asyncio.gather(*(send(s, urls[i % len(urls)] + "/v1/completions", prompts[i % len(prompts)],
                                           start + t) for i, t in enumerate(times)))


class Mocks:
    def __init__(self, workers: int):
        self.ports = [free_port() for _ in range(workers)]
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.scale.peer", "serve", *map(str, self.ports)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def start_router(policy: str, urls: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([str(BINARY), "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
                             "--worker-urls", *urls, "--log-level", "warning", "--health-check-interval-secs", "60",
                             "--request-timeout-secs", str(int(TIMEOUT_S)), "--prometheus-port", str(free_port())],
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if asyncio.run(_ok(url + "/health")):
                return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"vllm-router did not start; log in {log}")


async def _ok(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def run_one(policy: str, mocks: Mocks, prompts: list[str], rate: float, seconds: float, log: Path) -> dict:
    router, url = start_router(policy, mocks.urls, log)
    try:
        pin({"router": router.pid, "mocks": mocks.proc.pid, "bench": os.getpid()})
        asyncio.run(drive([url], prompts[:20], 20, 1.0, seed=1))   # warm: its connections to the workers
        c0 = cpu_s(router.pid)
        time.sleep(IDLE_S)
        idle_rate = (cpu_s(router.pid) - c0) / IDLE_S
        c1, t1 = cpu_s(router.pid), time.monotonic()
        via = asyncio.run(drive([url], prompts, rate, seconds))
        cpu, wall = cpu_s(router.pid) - c1, time.monotonic() - t1
    finally:
        router.terminate()
        router.wait(30)
    direct = asyncio.run(drive(mocks.urls, prompts, rate, seconds))
    ok_via, ok_direct = [x for x in via if x is not None], [x for x in direct if x is not None]
    p_via, p_direct = percentiles([1e3 * x for x in ok_via]), percentiles([1e3 * x for x in ok_direct])
    added = {q: round(p_via[q] - p_direct[q], 3) for q in ("p50", "p99")} if ok_via and ok_direct else None
    net_cpu = max(0.0, cpu - idle_rate * wall)
    return {"policy": policy, "workers": len(mocks.urls), "rate": rate, "offered": len(via), "answered": len(ok_via),
            "latency_ms": p_via, "direct_ms": p_direct, "added_ms": added,
            "cpu_ms_per_request": round(1e3 * net_cpu / len(ok_via), 3) if ok_via else None,
            "kept_up": len(ok_via) >= 0.99 * len(via) and (p_via["p99"] or 0) < 1e3}


def measure(workers: list[int], rates: list[float], policies: list[str], seconds: float, log_dir: Path) -> list[dict]:
    """Every (policy, W, rate); [] when vllm-router is not installed (scripts/peer_venvs.sh)."""
    if not BINARY.exists():
        print(f"bench-scale peer: {BINARY} not found (scripts/peer_venvs.sh installs it); left out")
        return []
    prompts = [text(p) for p in read_trace().probes]
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for w in workers:
        mocks = Mocks(w)
        try:
            for policy in policies:
                for rate in rates:
                    run = run_one(policy, mocks, prompts, rate, seconds, log_dir / f"vllm-router-{policy}-w{w}.log")
                    added = run["added_ms"] or {}
                    print(f"  vllm-router {policy} W={w} {rate:g} req/s: added p50/p99 {added.get('p50')}/"
                          f"{added.get('p99')} ms, {run['answered']} of {run['offered']} answered, "
                          f"{run['cpu_ms_per_request']} ms CPU per request", flush=True)
                    runs.append(run)
        finally:
            mocks.close()
    return runs


def summary(runs: list[dict]) -> dict:
    """The added p50 at 100 req/s with the most workers, cache_aware (the prefix-aware policy, as ours)."""
    at = [r for r in runs if r["rate"] == 100 and r["policy"] == "cache_aware" and r["added_ms"]]
    top = max(at, key=lambda r: r["workers"], default=None)
    return {"vllm_router_added_p50_ms_r100": top["added_ms"]["p50"] if top else None,
            "vllm_router_added_p99_ms_r100": top["added_ms"]["p99"] if top else None,
            "vllm_router_cpu_ms_per_request_r100": top["cpu_ms_per_request"] if top else None,
            "vllm_router_measured_at": {"workers": top["workers"], "policy": "cache_aware"} if top else None}


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        asyncio.run(serve_mocks([int(p) for p in sys.argv[2:]]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="4,256")
    ap.add_argument("--rates", default="100,1000")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()
    runs = measure([int(w) for w in args.workers.split(",")], [float(r) for r in args.rates.split(",")],
                   args.policies.split(","), args.seconds, Path("/tmp") / f"pdserve-peer-{os.getpid()}")
    print(json.dumps({"runs": runs, "summary": summary(runs)}, indent=1))


if __name__ == "__main__":
    main()
