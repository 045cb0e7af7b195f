"""Cost models of one worker shape, fitted to a profile's points (bench/planning/profile.py): pure
functions of plain numbers.

- A prefill pass of chunks (new tokens n_i after c_i tokens already computed or cached):
  a + b·Σn + c·Σ n_i²/2 + d·Σ n_i·c_i + e·chunks — the weights' cost per token, attention
  among the new tokens and over the context before them (a separate path: the cached blocks
  are read from the paged pool), and a per-sequence cost.
- A decode step of B sequences of L tokens each (their mean): interpolated in the measured
  grid of (B, L), linearly in each (attention over a batch's KV grows faster than linearly
  here, so no one formula fits), and beyond its edges along the last two points.
- The services' share of a decode step (publishing, relaying, the processes beside the
  engine), measured through the local stack: fixed + per sequence.
- The KV handoff past the prefill's last pass: a fixed cost plus the last layer's bytes at
  the measured rate (the earlier layers streamed during the prefill).
Coefficients are least squares kept non-negative (a feature whose weight comes out negative is
dropped and the rest refitted), so a prediction never falls as work grows.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

PREFILL_TERMS = ("fixed_s", "per_token_s", "self_attention_s", "context_attention_s", "per_seq_s")
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)  # one sequence to two: a matrix-vector product becomes a matrix product
DECODE_CONTEXTS = (64, 256, 1024)


STACKS = ("colocated", "disaggregated")  # the control plane is measured on each (bench/planning/profile.py)


def control_plane(profile: dict, stack: str) -> dict:
    """The services' share on a stack of that kind ({} when the profile has none)."""
    cp = profile.get("control_plane", {})
    return cp.get(stack, {}) if isinstance(cp.get(stack), dict) else cp


def shape_name(threads: int, neighbour: bool) -> str:
    return f"{threads}t" + ("+busy" if neighbour else "")


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    keep = np.ones(x.shape[1], dtype=bool)
    while True:
        coef = np.zeros(x.shape[1])
        coef[keep] = np.linalg.lstsq(x[:, keep], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef
        keep &= coef > 0


def prefill_features(new: list[int], cached: list[int]) -> list[float]:
    return [1.0, float(sum(new)), sum(n * n / 2 for n in new), float(sum(n * c for n, c in zip(new, cached))),
            float(len(new))]


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), extended past both ends along the end segments."""
    i = min(max(bisect_left(xs, x) - 1, 0), len(xs) - 2)
    return ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i])


def _fit(rows: list[list[float]], ys: list[float], names: tuple[str, ...]) -> dict:
    # relative error matters (a 16-token pass and a 2k one alike): each row weighted by 1/y
    x, y = np.asarray(rows), np.asarray(ys)
    coef = _nnls(x / y[:, None], np.ones_like(y))
    err = np.abs(x @ coef - y) / y
    return {**dict(zip(names, map(float, coef))), "max_rel_error": float(err.max()),
            "median_rel_error": float(np.median(err))}


def fit(raw: dict) -> dict:
    """The two cost models of one shape's points."""
    pre = _fit([prefill_features(p["new"], p["cached"]) for p in raw["prefill"]], [p["s"] for p in raw["prefill"]],
               PREFILL_TERMS)
    at = {(p["batch"], p["context"]): p["s"] for p in raw["decode"]}
    grid = [[at[b, n] for n in DECODE_CONTEXTS] for b in DECODE_BATCHES]
    return {"prefill_model": pre, "decode_model": {"batches": list(DECODE_BATCHES), "contexts": list(DECODE_CONTEXTS),
                                                   "step_s": grid}}


def level(shape: dict, probe: dict) -> dict:
    """How much slower (> 1) or faster this machine ran a shape's probe (bench/profile.probe:
    some of its points measured again) than its profile: the geometric mean over the points
    both hold of measured again / profiled, for prefill passes and decode steps apart."""
    def ratio(kind: str, key: Callable[[dict], tuple]) -> float:
        then = {key(p): p["s"] for p in shape[kind]}
        logs = [np.log(p["s"] / then[key(p)]) for p in probe[kind] if key(p) in then]
        return float(np.exp(np.mean(logs))) if logs else 1.0
    return {"prefill": ratio("prefill", lambda p: (tuple(p["new"]), tuple(p["cached"]))),
            "decode": ratio("decode", lambda p: (p["batch"], p["context"]))}


def fit_handoff(raw: dict) -> dict:
    rows = [[1.0, float(p["bytes"])] for p in raw["points"]]
    coef = _nnls(np.asarray(rows), np.asarray([p["s"] for p in raw["points"]]))
    return {**raw, "fixed_s": float(coef[0]), "gbps": 1 / max(coef[1], 1e-15) / 1e9}


def fit_service_step(profile: dict, stack: str) -> dict:
    """What the services add to a decode step of B sequences on a stack of that kind: fixed +
    per sequence (s), fitted to its B streams' TPOT through the stack minus the step the cost
    model gives the stack's own decode worker shape at that batch and context — the model the
    simulator adds the share to, so the two sum to what the stack measured ({} without points)."""
    cp = control_plane(profile, stack)
    if not cp.get("decode"):  # (a share stored without its points is taken as it is)
        return {k: cp[k] for k in ("step_fixed_s", "step_per_seq_s") if k in cp}
    cpus = profile.get("machine", {}).get("cpus", cp["threads"])
    shape = cp.get("shape") or shape_name(cp["threads"], cp["threads"] < cpus)
    if shape not in profile["shapes"]:  # not profiled here: no share rather than a guess
        return {}
    engine = Cost.of(profile, shape, None)
    context = cp.get("context", 40)
    rows = [[1.0, float(p["batch"])] for p in cp["decode"]]
    coef = _nnls(np.asarray(rows), np.asarray([max(0.0, p["tpot_s"] - engine.decode_s(p["batch"], p["batch"] * context))
                                               for p in cp["decode"]]))
    return {"step_fixed_s": float(coef[0]), "step_per_seq_s": float(coef[1]), "against": shape}


def describe_prefill(shape: dict) -> str:
    m = shape["prefill_model"]
    return (f"{1 / m['per_token_s']:.0f} tok/s + {m['fixed_s'] * 1e3:.1f} ms/pass (fit within "
            f"{m['max_rel_error']:.0%})")


def describe_decode(shape: dict) -> str:
    m = shape["decode_model"]
    return ", ".join(f"batch {b}: {row[0] * 1e3:.0f}-{row[-1] * 1e3:.0f} ms"
                     for b, row in zip(m["batches"], m["step_s"]))


@dataclass(frozen=True)
class Cost:
    """What a worker of one shape takes: seconds per prefill pass, decode step and handoff."""

    prefill: tuple[float, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    decode_grid: tuple[tuple[float, ...], ...]
    kv_bytes_per_token: int
    layers: int
    handoff_fixed_s: float
    handoff_bytes_per_s: float
    service_step_s: tuple[float, float] = (0.0, 0.0)  # the services' share of a decode step: fixed, per sequence
    _rows: dict[int, list[float]] = field(default_factory=dict, init=False, repr=False, compare=False)

    @classmethod
    def of(cls, profile: dict, shape: str, stack: str | None = "disaggregated") -> Cost:
        """A worker of `shape` serving on a `stack` of that kind (its control plane's share;
        None: the engine alone)."""
        s, h = profile["shapes"][shape], profile["handoff"]
        d, cp = s["decode_model"], fit_service_step(profile, stack) if stack else {}
        return cls(tuple(s["prefill_model"][k] for k in PREFILL_TERMS), tuple(d["batches"]), tuple(d["contexts"]),
                   tuple(map(tuple, d["step_s"])), s["kv_bytes_per_token"], s["layers"], h["fixed_s"],
                   h["gbps"] * 1e9, (cp.get("step_fixed_s", 0.0), cp.get("step_per_seq_s", 0.0)))

    def scaled(self, prefill: float, decode: float) -> Cost:
        """This shape on a machine `prefill` times slower at prefill passes and `decode` times at
        decode steps (its drift: `level`); the services' share of a step runs on the same cores."""
        return replace(self, prefill=tuple(t * prefill for t in self.prefill),
                       decode_grid=tuple(tuple(t * decode for t in row) for row in self.decode_grid),
                       service_step_s=(self.service_step_s[0] * decode, self.service_step_s[1] * decode))

    def prefill_s(self, chunks: list[tuple[int, int]]) -> float:
        """A pass of (new tokens, tokens before them) chunks."""
        a, b, c, d, e = self.prefill
        return a + sum(b * n + c * n * n / 2 + d * n * k + e for n, k in chunks)

    def mixed_s(self, chunks: list[tuple[int, int]], batch: int, context_tokens: int) -> float:
        """A mixed pass: these prompt chunks, and `batch` running sequences holding
        `context_tokens` in all, one new token each (a one-token chunk after its context), with
        the services' share of their step."""
        decode = [(1, context_tokens // max(batch, 1))] * batch
        return self.prefill_s(chunks + decode) + self.service_step_s[0] + self.service_step_s[1] * batch

    def step_s(self, batch: int, context_tokens: int) -> float:
        """A decode step as a serving worker takes it: the engine's, and the services' share."""
        return self.decode_s(batch, context_tokens) + self.service_step_s[0] + self.service_step_s[1] * batch

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """The engine's step of `batch` sequences holding `context_tokens` in all."""
        row = self._rows.get(batch)
        if row is None:  # the grid interpolated to this batch, once (bilinear: the same either way round)
            row = self._rows[batch] = [_interp(self.decode_batches, col, batch) for col in zip(*self.decode_grid)]
        xs, x = self.decode_contexts, context_tokens / max(batch, 1)
        i = min(max(bisect_left(xs, x) - 1, 0), len(xs) - 2)
        return max(row[i] + (row[i + 1] - row[i]) * (x - xs[i]) / (xs[i + 1] - xs[i]), self.decode_grid[0][0] / 2)

    def handoff_s(self, prompt_tokens: int) -> float:
        """The part of a streamed handoff after the prefill's last pass: its last layer."""
        return self.handoff_fixed_s + prompt_tokens * self.kv_bytes_per_token / self.layers / self.handoff_bytes_per_s
