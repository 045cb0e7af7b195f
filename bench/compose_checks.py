"""What make compose-check proves of the running compose stack (bench/compose_check.py), through
the gateway's published port: each check a dict with `ok` and what it saw, named in the JSON.

  ready                       the gateway's /ready (on its metrics port), with the pools registered
  no_restarts                 no container restarted on the way (each waited for what it needs)
  openai_sdk                  the official client: a chat answer, a stream, a tool call
  trace_spans_every_service   one request's trace at the OTLP receiver holds spans of the gateway,
                              the router, a prefill and a decode worker
  prometheus_targets_up       Prometheus's API: every target up, `vllm:generation_tokens_total` > 0
  services_unprivileged       every pdserve container runs as uid 10001 with no capability
  gateway_loopback_only       the gateway's port answers on 127.0.0.1 and on no other address here
  decode_killed_mid_stream    a decode container killed (of two) while streams run: none lost; each
                              stream's tokens against the same request's alone (greedy)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import traceback
import urllib.request
from collections.abc import Callable
from typing import Any

MODEL = "SmolLM2-135M-Instruct"
SERVICES = ("gateway", "router", "prefill", "decode", "issuer", "streams")
LONG = "Explain in one sentence why the sky is blue. " * 12   # long enough for the prefill pool


def _get(url: str, timeout: float = 10) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def ready(probes: str, timeout_s: float = 900) -> dict:
    t0 = time.monotonic()
    body: Any = None
    while time.monotonic() - t0 < timeout_s:
        try:
            status, raw = _get(probes + "/ready", 5)
            body = json.loads(raw)
            if status == 200:
                return {"ok": True, "after_s": round(time.monotonic() - t0, 1), "ready": body}
        except (OSError, ValueError) as e:
            body = str(e)
        time.sleep(2)
    return {"ok": False, "last": body}


def no_restarts(compose: Callable[..., str]) -> dict:
    ids = containers(compose)
    out = subprocess.run(["docker", "inspect", "-f", "{{.Name}} {{.RestartCount}} {{.State.Health}}", *ids],
                         capture_output=True, text=True).stdout
    counts = {line.split()[0].lstrip("/"): int(line.split()[1]) for line in out.splitlines() if line.strip()}
    return {"ok": bool(counts) and not any(counts.values()), "restarts": counts}


def openai_sdk(gw: str, key: str) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=gw + "/v1", api_key=key, timeout=120)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                          max_tokens=12, temperature=0)
    pieces = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG}], max_tokens=12, temperature=0, stream=True)
        if c.choices]
    weather: Any = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    tools = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                           tools=[weather], tool_choice="required", max_tokens=48, temperature=0)
    calls = [c.function for c in tools.choices[0].message.tool_calls or [] if c.type == "function"]
    return {"ok": bool(chat.choices[0].message.content) and len("".join(pieces)) > 0 and bool(calls)
            and calls[0].name == "get_weather",
            "chat": chat.choices[0].message.content, "stream_chunks": len(pieces),
            "tool_call": calls[0].arguments if calls else None}


def trace(gw: str, key: str, otlp_port: str) -> dict:
    trace_id = os.urandom(16).hex()
    req = urllib.request.Request(gw + "/v1/chat/completions", method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json",
        "traceparent": f"00-{trace_id}-{os.urandom(8).hex()}-01"},
        # (a prompt no worker has cached: a cached one is prefilled where it is cached, on the decode worker)
        data=json.dumps({"model": MODEL, "messages": [{"role": "user", "content": f"{trace_id}: {LONG}"}],
                         "max_tokens": 8, "temperature": 0}).encode())
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    want = {f"pdserve-{s}" for s in ("gateway", "router", "prefill", "decode")}
    seen: set[str] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not want <= seen:
        _, raw = _get(f"http://127.0.0.1:{otlp_port}/spans?trace_id={trace_id}")
        spans = json.loads(raw)
        seen = {s["service"] for s in spans}
        time.sleep(1)
    return {"ok": want <= seen, "services": sorted(seen), "spans": len(spans), "trace_id": trace_id}


def prometheus(port: str) -> dict:
    api = f"http://127.0.0.1:{port}/api/v1"
    deadline, targets, total = time.monotonic() + 60, [], 0.0
    while time.monotonic() < deadline:
        targets = [(t["labels"]["job"], t["labels"]["instance"], t["health"])
                   for t in json.loads(_get(api + "/targets")[1])["data"]["activeTargets"]]
        result = json.loads(_get(api + "/query?query=sum(vllm:generation_tokens_total)")[1])["data"]["result"]
        total = float(result[0]["value"][1]) if result else 0.0
        if targets and all(h == "up" for *_, h in targets) and total > 0:
            break
        time.sleep(3)
    jobs = {j for j, *_ in targets}
    return {"ok": bool(targets) and all(h == "up" for *_, h in targets) and total > 0
            and {"gateway", "router", "prefill", "decode", "issuer"} <= jobs,
            "targets": targets, "vllm_generation_tokens_total": total}


def containers(compose: Callable[..., str], service: str = "") -> list[str]:
    return [c for c in compose("ps", "-q", *([service] if service else [])).split() if c]


def unprivileged(compose: Callable[..., str]) -> dict:
    seen: dict[str, dict[str, str]] = {}
    for service in SERVICES:
        for c in containers(compose, service):
            status = subprocess.run(["docker", "exec", c, "cat", "/proc/1/status"], capture_output=True,
                                    text=True).stdout
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            seen[f"{service}/{c[:12]}"] = {"uid": (fields.get("Uid", "").split() or [""])[0],
                                           "cap_eff": fields.get("CapEff", "").strip()}
    return {"ok": bool(seen) and all(v["uid"] == "10001" and int(v["cap_eff"] or "1", 16) == 0
                                     for v in seen.values()), "containers": seen}


def loopback_only(port: str) -> dict:
    out = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True).stdout
    addresses = [f.split("/")[0] for line in out.splitlines() for f in line.split()[3:4]]

    def answers(host: str) -> bool:
        with socket.socket() as s:
            s.settimeout(2)
            return s.connect_ex((host, int(port))) == 0
    reach = {a: answers(a) for a in addresses}
    return {"ok": reach.get("127.0.0.1") is True and not any(v for a, v in reach.items() if a != "127.0.0.1"),
            "answers": reach}


def _stream(gw: str, key: str, prompt: str, out: dict, i: int, max_tokens: int) -> None:
    from openai import OpenAI

    try:
        client = OpenAI(base_url=gw + "/v1", api_key=key, timeout=300, max_retries=0)
        text = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0,
            stream=True) if c.choices]
        out[i] = "".join(text)
    except Exception as e:  # noqa: BLE001 - a lost request, recorded
        out[i] = e


def kill_decode(gw: str, key: str, compose: Callable[..., str], streams: int = 8, max_tokens: int = 48) -> dict:
    prompts = [f"Write a short story about the number {i}." for i in range(streams)]
    alone: dict[int, Any] = {}
    for i, p in enumerate(prompts):
        _stream(gw, key, p, alone, i, max_tokens)
    decodes = containers(compose, "decode")
    got: dict[int, Any] = {}
    threads = [threading.Thread(target=_stream, args=(gw, key, p, got, i, max_tokens)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    time.sleep(3)
    subprocess.run(["docker", "kill", "-s", "KILL", decodes[0]], capture_output=True)
    for t in threads:
        t.join(600)
    lost = [i for i, v in got.items() if isinstance(v, Exception)] + [i for i in range(streams) if i not in got]
    equal = [i for i in range(streams) if isinstance(got.get(i), str) and got[i] == alone.get(i)]
    return {"ok": not lost and len(decodes) == 2, "streams": streams, "lost": len(lost), "equal_to_alone": len(equal),
            "decode_replicas": len(decodes), "errors": [str(got[i])[:200] for i in lost if i in got]}


def run_all(env: dict[str, str], key: str, compose: Callable[..., str]) -> dict[str, dict]:
    gw = f"http://127.0.0.1:{env['GATEWAY_PORT']}"
    checks: dict[str, Callable[[], dict]] = {
        "ready": lambda: ready(f"http://127.0.0.1:{env['GATEWAY_METRICS_PORT']}"),
        "no_restarts": lambda: no_restarts(compose),
        "openai_sdk": lambda: openai_sdk(gw, key),
        "trace_spans_every_service": lambda: trace(gw, key, env["OTLP_PORT"]),
        "prometheus_targets_up": lambda: prometheus(env["PROMETHEUS_PORT"]),
        "services_unprivileged": lambda: unprivileged(compose),
        "gateway_loopback_only": lambda: loopback_only(env["GATEWAY_PORT"]),
        "decode_killed_mid_stream": lambda: kill_decode(gw, key, compose),
    }
    results: dict[str, dict] = {}
    for name, check in checks.items():
        t0 = time.monotonic()
        try:
            results[name] = check()
        except Exception:  # noqa: BLE001 - a check that breaks fails, with its traceback
            results[name] = {"ok": False, "error": traceback.format_exc()[-1500:]}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"  {name}: {'ok' if results[name]['ok'] else 'FAILED'} ({results[name]['seconds']} s)", flush=True)
        if name == "ready" and not results[name]["ok"]:
            break
    return results
