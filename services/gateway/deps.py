"""What every route needs, held once per process and injected with Annotated aliases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from shared.bus import Bus
from shared.config import GatewaySettings
from shared.engine.config import ModelConfig
from shared.engine.tokenizer import Tokenizer
from shared.state import State
from services.gateway.relay import Relay


@dataclass
class Gateway:
    settings: GatewaySettings
    bus: Bus
    state: State
    tokenizer: Tokenizer
    model_config: ModelConfig
    relay: Relay


def _gateway(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(_gateway)]
