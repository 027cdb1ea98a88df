"""Counter-based random streams (docs/design.md §3.2): every number a pure function of (seed, choice,
position, purpose, worker, lane), Philox-4x32-10 keyed by (seed, choice, purpose, worker); lane 0 is a chain's
stream (§3.6)."""

from __future__ import annotations

import bisect
import hashlib
import itertools
from enum import IntEnum

import torch


class Purpose(IntEnum):
    """What a random number is for; each purpose is its own stream."""

    DRAFT_SAMPLE = 1  # the draft's x_j ~ q̂_j
    ACCEPT = 2  # r_j of the accept test r_j < min(1, p/q)
    RESIDUAL = 3  # the recovered token from norm(max(0, p − q))
    BONUS = 4  # the bonus token from p_{γ+1} (drawn at the gateway)
    WORKER_SAMPLE = 5  # a worker's own sample z_n ~ T(p_n) (autoregressive)
    WORKER_COMPLEMENT = 6  # a worker's y_n ~ p_n(· | x ∉ S_j) (exact)
    WORKER_BONUS = 7  # a worker's bonus sample (exact)
    WORKER_CHOICE = 8  # which worker's sample to emit, n ~ w


def uniform(seed: int, choice: int, position: int, purpose: Purpose, worker: int = 0, lane: int = 0) -> float:
    """One U[0, 1) number of the stream (seed, choice, purpose, worker) at ``position``, ``lane``."""
    return _uniform(_stream_key(seed, choice, purpose, worker), position, lane)


def uniforms(
    seed: int, choice: int, positions: list[int], purpose: Purpose, worker: int = 0, lane: int = 0
) -> torch.Tensor:
    """U[0, 1) numbers for several positions of one stream: ``[len(positions)]`` float64."""
    key = _stream_key(seed, choice, purpose, worker)
    return torch.tensor([_uniform(key, position, lane) for position in positions], dtype=torch.float64)


def _uniform(key: tuple[int, int], position: int, lane: int = 0) -> float:
    if not 0 <= lane <= _MASK32:
        raise ValueError(f"lane must lie in [0, 2**32), got {lane}")
    w0, w1, _, _ = philox4x32((position & _MASK32, position >> 32, lane, 0), key)
    return ((w0 | (w1 << 32)) >> 11) * 2.0**-53  # 53 random bits


def stream_key(seed: int, choice: int, purpose: Purpose, worker: int = 0) -> tuple[int, int]:
    """The Philox key (two 32-bit words) of the stream (seed, choice, purpose, worker): what
    ``philox_uniforms`` takes."""
    return _stream_key(seed, choice, purpose, worker)


def philox_uniforms(
    keys: torch.Tensor,  # [n, 2] int64: each number's stream key (``stream_key``)
    positions: torch.Tensor,  # [n] int64 ≥ 0
    lanes: torch.Tensor | None = None,  # [n] int64 in [0, 2³²); None: lane 0
) -> torch.Tensor:  # [n] float64, where the tensors are
    """``uniform`` of every (key, position, lane) as tensor ops: the host's Philox-4x32-10 bit for bit, on any
    device, with nothing read back (issue 73: a step's uniforms made where its rows are, not 10 µs each in
    Python). Products of two 32-bit words are taken in 16-bit halves, so every intermediate fits int64 without
    overflow."""
    c0, c1 = positions & _MASK32, positions >> 32
    c2 = lanes if lanes is not None else torch.zeros_like(positions)
    c3 = torch.zeros_like(positions)
    k0, k1 = keys[:, 0], keys[:, 1]
    for _ in range(10):
        # the multipliers and bumps as Python ints: no constant tensor made (on a GPU, a copy from the host)
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    bits = (c1 << 21) | (c0 >> 11)  # ((w0 | w1 << 32) >> 11): the top 53 bits of w1:w0
    return bits.double() * 2.0**-53


def _mulhilo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The high and low 32-bit words of ``a · x`` (both < 2³²), in int64 without overflow."""
    upper, lower = (x >> 16) * a, (x & 0xFFFF) * a  # each < 2⁴⁸
    middle = ((upper & 0xFFFF) << 16) + lower  # < 2⁴⁹
    return (upper >> 16) + (middle >> 32), middle & _MASK32


def round_seed(seed: int, round_index: int) -> int:
    """The seed of one round's draws (in [0, 2**63)), for a request whose rounds take their shape from what
    the rounds before drew (``num_draft_tokens: auto``): keyed by position alone, a round would draw again
    a number that chose its γ (a draft cut short by EOS at a position left undecided)."""
    digest = hashlib.blake2b(f"{seed}:round:{round_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _stream_key(seed: int, choice: int, purpose: Purpose, worker: int) -> tuple[int, int]:
    digest = hashlib.blake2b(f"{seed}:{choice}:{int(purpose)}:{worker}".encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


_MASK32 = 0xFFFFFFFF


def philox4x32(
    counter: tuple[int, int, int, int], key: tuple[int, int], rounds: int = 10
) -> tuple[int, int, int, int]:
    """Philox-4x32-10 (Salmon et al., SC'11): four 32-bit words of a counter under a key."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & _MASK32
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    return c0, c1, c2, c3


def accepts(
    u: float,  # U[0, 1)
    probability: float,  # of a yes
) -> bool:
    """``u < probability``: with ``count_accepts``, ``sample_index`` and ``sample_rows``, the only places a
    uniform is consumed (tests enumerate every draw)."""
    return u < probability


def count_accepts(
    u: torch.Tensor,  # [γ] U[0, 1)
    probabilities: torch.Tensor,  # [γ]: of a yes at each test
) -> torch.Tensor:  # 0-dim long, where the tensors are
    """How many leading tests ``u_j < a_j`` pass (``first_rejection``'s count) as tensor ops: nothing read
    back, so a device's accept test runs where its rows are. The tests past the first failure decide nothing
    (tests/draws.py draws only up to it)."""
    return torch.cumprod((u.double().to(probabilities.device) < probabilities.double()).long(), dim=0).sum()


def sample_index(
    probs: torch.Tensor,  # [V], ≥ 0, need not be normalised
    u: float,  # U[0, 1)
) -> int:
    """Inverse-CDF draw: the first index whose cumulative mass exceeds ``u · total``. A short row (a truncated
    support) is summed in Python floats: the same sequential float64 sums as ``torch.cumsum``, without its
    tensors."""
    if probs.shape[0] <= SHORT_ROW:
        return _sample_short(probs.double().tolist(), u)
    cdf = torch.cumsum(probs.double(), dim=0)
    total = float(cdf[-1])
    if not total > 0:
        raise ValueError("cannot sample from a distribution with no mass")
    index = int(torch.searchsorted(cdf, u * total, right=True))
    if index < probs.shape[0]:
        return index  # cdf[index] > u·total ≥ cdf[index − 1]: an entry with mass
    return int((probs > 0).nonzero()[-1, 0])  # u·total rounded up to the total: the last entry with mass


SHORT_ROW = 64  # rows up to this long are drawn from in Python


def _sample_short(values: list[float], u: float) -> int:
    cdf = list(itertools.accumulate(values))
    total = cdf[-1] if cdf else 0.0
    if not total > 0:
        raise ValueError("cannot sample from a distribution with no mass")
    index = bisect.bisect_right(cdf, u * total)
    if index < len(values):
        return index
    # u·total rounded up to the total: the last entry with mass
    return max(i for i, value in enumerate(values) if value > 0)


def row_cumsum(rows: torch.Tensor) -> torch.Tensor:  # [R, V] -> [R, V]
    """The cumulative sums along each row, each row's the same bits however many rows are summed with it: on a
    GPU a one-row cumsum takes another kernel (a whole-tensor scan) than a multi-row one (each row scanned
    alone), so a single row is scanned beside a row of zeros there (issue 73: a seeded call's draw may not
    depend on what shares its step)."""
    if rows.shape[0] == 1 and rows.device.type != "cpu":
        return torch.cumsum(torch.cat([rows, torch.zeros_like(rows)]), dim=-1)[:1]
    return torch.cumsum(rows, dim=-1)


def sample_rows(
    probs: torch.Tensor,  # [R, V], ≥ 0, need not be normalised
    u: torch.Tensor,  # [R] U[0, 1)
) -> torch.Tensor:  # [R] long: sample_index of each row (0 for a row with no mass)
    """``sample_index`` of every row at once, with its very numbers (a row's cumulative sum is the same
    computed alone or in a batch); nothing read back to the host, so a device's rows are drawn where they
    are."""
    cdf = row_cumsum(probs.double())
    total = cdf[:, -1]
    index = torch.searchsorted(cdf, (u.double().to(cdf.device) * total)[:, None], right=True)[:, 0]
    width = probs.shape[1]
    has_mass = probs > 0
    # the last entry with mass
    last = (width - 1) - torch.argmax(torch.flip(has_mass, dims=[1]).to(torch.int8), dim=1)
    fallback = torch.where(has_mass.any(dim=1), last, torch.zeros_like(last))
    return torch.where(index >= width, fallback, index)  # u·total rounded up to the total
