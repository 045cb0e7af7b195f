"""`pdserve serve` (what `make run` does): the local stack (pdserve/local/stack.py) in the foreground,
shaped by its flags and PD_*, until Ctrl-C."""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdserve.local.stack import Stack, StackConfig
from pdserve.shared import grants
from pdserve.shared.config import model_id


class ServeSettings(BaseSettings):
    """The local stack's shape (`pdserve serve`, `make run`); each service takes its other settings from PD_*."""
    model_config = SettingsConfigDict(env_prefix="PD_", extra="ignore")

    prefill: int = Field(1, ge=0, description="prefill workers")
    decode: int = Field(1, ge=1, description="decode workers")
    colocated: bool = Field(False, description="no prefill pool: decode workers do both")
    ha: bool = Field(False, description="a 3-node NATS cluster and Redis with a replica and 3 Sentinels (the first "
                     "node and the primary on nats_port / redis_port)")
    redis_cluster: int = Field(0, ge=0, description="Redis as a Redis Cluster of this many primaries (the first on "
                               "redis_port; PD_REDIS_URL=redis+cluster://)")
    tls: bool = Field(False, description="NATS and Redis on mutual TLS: a CA, the servers' and each instance's "
                      "certificate made at start (under the stack's private data directory)")
    issuer: bool = Field(False, description="instances let in by the identity issuer as compose and Kubernetes "
                         "run them: each a NATS and Redis user named after the key it makes (pdserve/services/issuer)")
    port: int = Field(8000, description="the gateway's port")
    nats_port: int = Field(4222, description="NATS's port")
    redis_port: int = Field(6379, description="Redis's port")
    model: str = Field("smollm2", description="smollm2, a .gguf file, a safetensors directory or a Hugging Face Hub "
                       "id (served as its own name; model_name overrides)")
    model_name: str = Field("", description="the id clients ask for (default: the model's own name)")
    kv_blocks: int = Field(2048, gt=0, description="each worker's KV pool, in blocks of 16 tokens")
    threads: int = Field(0, ge=0, description="torch threads per worker (0: cores / workers)")

    def config(self) -> StackConfig:
        return StackConfig(prefill=self.prefill, decode=self.decode, colocated=self.colocated, ha=self.ha,
                           redis_cluster=self.redis_cluster, tls=self.tls, issuer=self.issuer, gateway_port=self.port,
                           nats_port=self.nats_port, redis_port=self.redis_port,
                           model=self.model, kv_blocks=self.kv_blocks, threads=self.threads,
                           log_dir=Path(".run/logs"), env={"PD_MODEL_NAME": self.model_name} if self.model_name else {})


def main(args: ServeSettings) -> None:
    """The stack in the foreground until Ctrl-C (`pdserve serve`: `args` from its flags and PD_*)."""
    stack = Stack(args.config())
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C stops, even when started with SIGINT ignored
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    start = time.monotonic()
    pools = f"{args.decode} colocated" if args.colocated else f"{args.prefill} prefill + {args.decode} decode"
    pools += " worker(s)" + ("; NATS cluster of 3, Redis primary + replica + 3 Sentinels" if args.ha else "")
    pools += f"; a Redis Cluster of {args.redis_cluster}" if args.redis_cluster else ""
    pools += "; NATS and Redis on mutual TLS" if args.tls else ""
    pools += "; instances let in by the identity issuer" if args.issuer else ""
    print(f"starting pdserve: {pools}; logs in {stack.log_dir}/", flush=True)
    try:
        stack.start()
        env_file = Path(".run/stack.env")  # for operator tools (python -m pdserve.shared.tools.timeline)
        env_file.touch(mode=0o600)
        tls = "".join(f"{k}={v}\n" for k, v in stack.tls_env(grants.OPERATOR).items())
        env_file.write_text(f"PD_NATS_URL={stack.nats_url}\nPD_REDIS_URL={stack.redis_url}\n{tls}")
        scraped = [n for n in stack.procs if n in stack.metrics_ports]   # (not the servers, the keeper)
        metrics = ", ".join(f"{n} {stack.metrics_url(n)}" for n in scraped)
        served = args.model_name or model_id(args.model)
        print(f"ready in {time.monotonic() - start:.1f} s at {stack.url}\n\n"
              f"  curl {stack.url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"{served}\", \"messages\": "
              f"[{{\"role\": \"user\", \"content\": \"What is the capital of Japan?\"}}]}}'\n\n"
              f"  a model without a chat template (gemma3-270m, a base model) takes text:\n"
              f"  curl {stack.url}/v1/completions -H 'Content-Type: application/json' \\\n"
              f"    -d '{{\"model\": \"{served}\", \"prompt\": \"The capital of France is\", \"max_tokens\": 16}}'\n\n"
              f"  metrics: {metrics}\n\n"
              "Ctrl-C stops everything.", flush=True)
        while all(p.poll() is None for p in stack.procs.values()):
            time.sleep(0.5)
        dead = [n for n, p in stack.procs.items() if p.poll() is not None]
        print(f"{', '.join(dead)} exited; stopping (see {stack.log_dir}/)", flush=True)
    except KeyboardInterrupt:
        print("\nstopping…", flush=True)
    except (RuntimeError, TimeoutError) as e:
        print(f"failed to start: {e}", file=sys.stderr, flush=True)
    finally:
        stack.stop()


if __name__ == "__main__":  # the same as `pdserve serve`, its flags and PD_*
    from pdserve.services.cli import main as pdserve

    sys.exit(pdserve(["serve", *sys.argv[1:]]))
