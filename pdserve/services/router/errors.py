"""Failures of a store or a bus, not of the code: a route or a requeue that meets one logs a
line and answers that it failed (anything else: the traceback too)."""

from __future__ import annotations

import asyncio

import nats.errors
from redis.exceptions import RedisError

EXPECTED = (RedisError, asyncio.TimeoutError, nats.errors.Error)
