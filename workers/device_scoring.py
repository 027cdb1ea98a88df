"""A step's scoring where its logits are (issue 60, item 2): every call's rows scored together — ``T(p)`` for
all rows at once, each row with its own sampling parameters — then each call's payload as tensor ops that
never read a value back: top-k or full rows with their reconstruction error, ``autoregressive``'s sample,
``exact``'s supports, complement masses and samples (chains and trees), ``split``'s accept test with its bonus
or the row at the rejection, the logprobs asked. What the host brings (the draft, supports, row parameters,
each uniform's stream key and position) travels in the step's one upload (core.runners.step_upload, with the
forward's inputs); the uniforms are made there by Philox as ``score`` draws them, bit for bit
(core.math.random.philox_uniforms); every result lands in one buffer that crosses back **once**. Between the
upload and that copy nothing waits for the host (tests/workers/test_step_syncs.py). ``score``
(workers.scoring) stays the reference and answers what ``handles`` leaves it: echo (``score_tokens``) and
``score_ids``. tests/workers/test_device_scoring.py holds the two to each other on CPU tensors."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from core.math.aggregation import reconstruct, tv_distance
from core.math.batched_sampling import RowParams, apply_sampling_rows, largest_k, truncations
from core.math.random import Purpose, count_accepts, philox_uniforms, sample_rows, stream_key
from core.math.sampling import normalised
from core.math.speculative import acceptance_probs
from core.math.tree import depths_of
from core.modes import ROWS, SAMPLE, SPARSE, VERDICT, scoring_of
from core.names import Reconstruction
from core.protocol import VerifyRequest, VerifyResponse
from core.runners.step_upload import Segment, StepUpload
from workers.scoring import sampling_params


def handles(req: VerifyRequest) -> bool:
    """Whether ``score_step`` answers ``req`` as ``score`` would (echo and ``score_ids`` stay with
    ``score``)."""
    return req.score_ids is None and not req.score_tokens


class _Numbers:
    """A step's host numbers for its calls, queued in the step's upload: values (float64) and the uniforms'
    stream keys and positions, made into uniforms on the device once the upload has landed (``made``)."""

    def __init__(self, upload: StepUpload) -> None:
        self.upload = upload
        self._values: list[np.ndarray] = []
        self._size = 0
        self._keys: list[tuple[int, int]] = []
        self._positions: list[int] = []
        self.segments: tuple[Segment, Segment, Segment] | None = None
        self.values: torch.Tensor | None = None
        self.uniforms: torch.Tensor | None = None

    def add(self, values: list[float] | np.ndarray) -> slice:
        array = np.asarray(values, dtype=np.float64).reshape(-1)
        self._values.append(array)
        self._size += array.size
        return slice(self._size - array.size, self._size)

    def draws(self, seed: int, choice: int, positions: list[int], purpose: Purpose, worker: int = 0) -> slice:
        """The uniforms ``uniform(seed, choice, p, purpose, worker)`` for each of ``positions``: where they
        will lie."""
        key = stream_key(seed, choice, purpose, worker)
        start = len(self._positions)
        self._keys += [key] * len(positions)
        self._positions += positions
        return slice(start, len(self._positions))

    def queue(self) -> None:
        """Into the upload: the values, the keys and the positions."""
        values = np.concatenate(self._values) if self._values else np.zeros(0)
        keys = np.asarray(self._keys, dtype=np.int64).reshape(-1, 2)
        self.segments = (
            self.upload.add(values),
            self.upload.add(keys),
            self.upload.add(np.asarray(self._positions, dtype=np.int64)),
        )

    def landed(self) -> None:
        """Once the upload is sent: the values' view, and every uniform of the step made in one pass of
        Philox."""
        assert self.segments is not None
        values, keys, positions = (self.upload.view(segment) for segment in self.segments)
        self.values = values
        self.uniforms = (
            philox_uniforms(keys, positions)
            if positions.numel()
            else torch.zeros(0, dtype=torch.float64, device=values.device)
        )

    def __getitem__(self, where: slice) -> torch.Tensor:
        assert self.values is not None
        return self.values[where]

    def u(self, where: slice) -> torch.Tensor:
        assert self.uniforms is not None
        return self.uniforms[where]


class _Pack:
    """A step's results flattened into one float32 buffer copied to the host once: probabilities as float32
    values, float64 tensors (exact's complement masses) and integers as their float64 bits, two float32 words
    a value."""

    def __init__(self) -> None:
        self._chunks: list[torch.Tensor] = []
        self._shapes: list[tuple[tuple[int, ...], bool]] = []
        self.host: list[np.ndarray] = []

    def add(self, tensor: torch.Tensor, wide: bool = False) -> int:
        """``wide``: keep float64 (its bits travel); else the values as float32. Integers (ids, samples,
        counts) go wide: a vocabulary may pass 2²⁴, where float32 stops counting by ones."""
        wide = wide or not tensor.is_floating_point()
        flat = tensor.reshape(-1)
        self._chunks.append(flat.double().view(torch.float32) if wide else flat.float())
        self._shapes.append((tuple(tensor.shape), wide))
        return len(self._chunks) - 1

    def chunks(self) -> torch.Tensor | None:
        """Every result in one float32 buffer where they were computed (queued, not waited for)."""
        return torch.cat(self._chunks) if self._chunks else None

    def copy(self, upload: StepUpload, flat_device: torch.Tensor | None) -> None:
        # the step's one copy
        flat = upload.download(flat_device) if flat_device is not None else np.zeros(0, dtype=np.float32)
        at = 0
        for shape, wide in self._shapes:
            size = int(np.prod(shape)) * (2 if wide else 1)
            part = flat[at : at + size]
            self.host.append((part.copy().view(np.float64) if wide else part).reshape(shape))
            at += size

    def __getitem__(self, index: int) -> np.ndarray:
        return self.host[index]


Finish = Callable[[_Pack], VerifyResponse]


@dataclass
class _Rows:
    """One call's rows of the step: ``T(p)``, whether each logit was finite, and the rows sorted by falling
    probability."""

    probs: torch.Tensor  # [n, V] fp32
    finite: torch.Tensor | None  # [n, V] bool, where some call's residual needs it (none: as all finite)
    # [n, V] probabilities, falling; ties: the lowest id first (as compress_top_k)
    ordered: torch.Tensor | None
    order: torch.Tensor | None  # [n, V] their ids
    # where the step's row sums lie in the pack, and this call's first row among them
    totals: tuple[int, int] = (-1, 0)

    def take(self, index: torch.Tensor) -> _Rows:  # rows by a device index, nothing read back
        pick = lambda t: None if t is None else t.index_select(0, index)  # noqa: E731
        return _Rows(
            self.probs.index_select(0, index), pick(self.finite), pick(self.ordered), pick(self.order)
        )

    def need_mass(self, host: _Pack, row: int) -> None:
        """A draw from ``row`` needs mass there, as ``sample_index`` says (a row with none: the host's error,
        not a token 0)."""
        at, first = self.totals
        if not host[at][first + row] > 0:
            raise ValueError("cannot sample from a distribution with no mass")


class StepScoring:
    """A step's device-scored calls in two halves: built before the step's upload (every host number the calls
    need queued in it, the uniforms as stream keys and positions), ``score`` once it has landed
    (``upload.send``, which the forward makes): the calls' answers from their rows, with one copy back."""

    def __init__(self, reqs: list[VerifyRequest], upload: StepUpload) -> None:
        self.reqs = reqs
        self.sizes = [len(req.draft) + 1 for req in reqs]
        numbers = self.numbers = _Numbers(upload)
        self._params = [
            numbers.add([v for req, n in zip(reqs, self.sizes) for v in [getattr(req, name)] * n])
            for name in ("temperature", "top_k", "top_p", "min_p")
        ]
        self._needs = [_kind(req).numbers(req, numbers) for req in reqs]
        numbers.queue()

    def score(
        self, logits: torch.Tensor, present: list[int], helds: list[int], model_ms: float
    ) -> list[VerifyResponse]:
        """``logits``: the rows ``[R, V]`` (fp32, any device) of the calls at ``present`` (indices into the
        calls, in order), each call's γ + 1 rows (transformed already where a call has a transform); their
        answers, in that order."""
        return self.launch(logits, present, helds, model_ms)()

    def launch(
        self, logits: torch.Tensor, present: list[int], helds: list[int], model_ms: float
    ) -> Callable[[], list[VerifyResponse]]:
        """``score``'s device work, queued (nothing waits for it); the function that copies the results back
        and answers."""
        numbers = self.numbers
        numbers.landed()
        vocab = logits.shape[-1]
        reqs = [self.reqs[i] for i in present]
        asked = [sampling_params(req) for req in reqs for _ in range(len(req.draft) + 1)]
        params = [numbers[part] for part in self._params]
        if len(present) < len(self.reqs):
            # the rows of the calls whose forward answered, by slices (no index to upload)
            starts = np.cumsum([0, *self.sizes]).tolist()
            params = [torch.cat([values[starts[i] : starts[i + 1]] for i in present]) for values in params]
        rows = RowParams(
            params[0].float(),
            params[1].long(),
            params[2].float(),
            params[3].float(),
            truncations(asked),
            largest_k(asked),
        )
        probs = apply_sampling_rows(logits, rows)  # [R, V]
        residual = any(
            req.k is not None and req.k < vocab and req.reconstruction != Reconstruction.RENORMALIZE.value
            for req in reqs
        )
        finite = torch.isfinite(logits) if residual else None  # where a residual spreads σ
        most = max((req.k for req in reqs if req.k is not None and req.k < vocab), default=0)
        ordered = order = None
        if most:
            ordered, order = top_entries(probs, most)
        pack = _Pack()
        # NaN: a row the host's scoring refuses; 0: a row no draw may come from
        totals = pack.add(probs.sum(dim=-1))
        finishes: list[Finish] = []
        start = 0
        for i, req, held in zip(present, reqs, helds):
            n = self.sizes[i]
            part = slice(start, start + n)
            pick = lambda t, part=part: None if t is None else t[part]  # noqa: E731
            call = _Rows(probs[part], pick(finite), pick(ordered), pick(order), (totals, start))
            finishes.append(_kind(req).score(call, req, held, model_ms, numbers, self._needs[i], pack))
            start += n
        # the step's results in one buffer, made now: the copy back waits for nothing else queued later
        chunks = pack.chunks()

        def collect() -> list[VerifyResponse]:
            pack.copy(numbers.upload, chunks)
            if np.isnan(pack[totals]).any():
                # the host's scoring says which call (workers.step scores them there, one by one)
                raise ValueError("a row of the step's probabilities is NaN")
            return [finish(pack) for finish in finishes]

        return collect


def score_step(
    logits: torch.Tensor, reqs: list[VerifyRequest], helds: list[int], model_ms: float
) -> list[VerifyResponse]:
    """Every call of ``reqs`` scored together where ``logits`` (``[R, V]``: each call's γ + 1 rows, in order)
    are: the two halves of ``StepScoring`` around an upload of their own (a worker's step shares the
    forward's)."""
    upload = StepUpload(logits.device, words=1024)
    upload.begin()
    scoring = StepScoring(reqs, upload)
    upload.send()
    return scoring.score(logits, list(range(len(reqs))), helds, model_ms)


def top_entries(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # [R, k] values, [R, k] ids
    """Each row's k largest probabilities by falling value, ties to the lowest id (as ``compress_top_k``), by
    one ``topk`` over keys that are all distinct — a probability's bits above the complement of its id — not a
    sort of the vocabulary: ``topk`` orders ties as it likes on a GPU, distinct keys leave it no tie."""
    ids = torch.arange(probs.shape[-1], device=probs.device)
    # −0.0 made +0.0 (its bits would read as a negative number): a tie with it, as a sort has it
    positive = probs.float() + 0.0
    # probabilities ≥ 0: their bits order as they do
    keys = (positive.view(torch.int32).long() << 32) | (_ID_MASK - ids)
    top = torch.topk(keys, k, dim=-1).values
    return (top >> 32).int().view(torch.float32), _ID_MASK - (top & _ID_MASK)


_ID_MASK = 0xFFFFFFFF


def _no_numbers(req: VerifyRequest, numbers: _Numbers) -> dict[str, slice]:
    return {}


def _sample_numbers(req: VerifyRequest, numbers: _Numbers) -> dict[str, slice]:
    """The draw autoregressive's sample takes (``workers.scoring._sample``), as a stream key."""
    base = req.prefix_len + len(req.tokens)
    return {"u": numbers.draws(req.seed, req.choice, [base], Purpose.WORKER_SAMPLE, req.worker)}


def _verdict_numbers(req: VerifyRequest, numbers: _Numbers) -> dict[str, slice]:
    """What split's accept test reads or draws on the host (``workers.scoring._split``), queued for the
    step's one upload (its draws as stream keys)."""
    gamma, base, sampled = len(req.draft), req.prefix_len + len(req.tokens), req.temperature > 0
    seed, choice, worker = req.seed, req.choice, req.worker
    out = {"draft": numbers.add(req.draft.astype(np.int64))}
    if sampled:
        out["q"] = numbers.add(np.array(req.draft_probs, dtype=np.float64))
        out["u"] = numbers.draws(seed, choice, list(range(base, base + gamma)), Purpose.ACCEPT, worker)
        out["bonus_u"] = numbers.draws(seed, choice, [base + gamma], Purpose.BONUS, worker)
        if req.support_q is not None and gamma:
            # the token at a rejection drawn here (workers.scoring.split_residual_draw)
            out["ids"] = numbers.add(np.asarray(req.support_ids, dtype=np.int64))
            out["row_of"] = numbers.add(
                np.repeat(np.arange(gamma), np.asarray(req.support_sizes, dtype=np.int64))
            )
            out["support_q"] = numbers.add(np.asarray(req.support_q, dtype=np.float64))
            out["residual_u"] = numbers.draws(seed, choice, list(range(base, base + gamma)), Purpose.RESIDUAL)
    return out


def _sparse_numbers(req: VerifyRequest, numbers: _Numbers) -> dict[str, slice]:
    """What exact's sparse rows read or draw on the host (``workers.scoring._exact``)."""
    gamma, base = len(req.draft), req.prefix_len + len(req.tokens)
    seed, choice, worker = req.seed, req.choice, req.worker
    sizes = np.asarray(req.support_sizes, dtype=np.int64)
    depths = [0, *depths_of(req.parents.tolist())] if req.parents is not None else list(range(gamma))
    out = {"draft": numbers.add(req.draft.astype(np.int64))}
    out["ids"] = numbers.add(np.asarray(req.support_ids, dtype=np.int64))
    out["row_of"] = numbers.add(np.repeat(np.arange(len(sizes)), sizes))
    out["u"] = numbers.draws(
        seed, choice, [base + d for d in depths[: len(sizes)]], Purpose.WORKER_COMPLEMENT, worker
    )
    if req.parents is None:
        out["bonus_u"] = numbers.draws(seed, choice, [base + gamma], Purpose.WORKER_BONUS, worker)
    return out


def _rows_call(
    rows: _Rows,
    req: VerifyRequest,
    held: int,
    model_ms: float,
    numbers: _Numbers,
    need: dict[str, slice],
    pack: _Pack,
    sampled: bool = False,
) -> Finish:
    """One call's device work, queued into ``pack``; what builds its answer once the pack is on the host:
    T(p) rows as asked; ``sampled`` (autoregressive at T > 0): first the worker's own z ~ T(p) at its one
    position, and the row only if asked."""
    sample = None
    if sampled:
        sample = pack.add(sample_rows(rows.probs[:1], numbers.u(need["u"])))
    payload = (
        None if sample is not None and not req.return_probs else _distributions(rows, req, pack, rows.finite)
    )

    def finish(host: _Pack) -> VerifyResponse:
        if sample is not None:
            rows.need_mass(host, 0)
        samples = None if sample is None else host[sample].astype(np.int32)
        if payload is None:
            return VerifyResponse(held=held, samples=samples, model_ms=model_ms)
        return VerifyResponse(
            held=held, samples=samples, probs_dtype=req.probs_dtype, model_ms=model_ms, **payload(host)
        )

    return finish


def _distributions(
    rows: _Rows, req: VerifyRequest, pack: _Pack, allowed: torch.Tensor | None
) -> Callable[[_Pack], dict[str, Any]]:
    """``T(p)`` as the call asks it on the wire: whole rows, or the top k with σ and e_n for its
    reconstruction (``allowed``: where a residual spreads σ; all finite logits is the same as none)."""
    n, vocab = rows.probs.shape
    if req.k is None or req.k == vocab:
        full = pack.add(rows.probs)
        zeros = np.zeros(n, dtype=np.float32)
        return lambda host: {"probs": host[full].astype(np.float32), "tail_mass": zeros, "recon_error": zeros}
    assert rows.ordered is not None and rows.order is not None
    k = int(req.k)
    ids, values = rows.order[:, :k], rows.ordered[:, :k]
    kept = torch.zeros_like(rows.probs, dtype=torch.bool).scatter_(-1, ids, True)
    tail = rows.probs.masked_fill(kept, 0).sum(dim=-1, dtype=torch.float64).float()
    method = Reconstruction(req.reconstruction)
    if method is Reconstruction.RENORMALIZE:
        error = tail  # TV(p/ρ on S, p) = σ exactly
    else:
        error = tv_distance(reconstruct(ids, values, vocab, method, tail, allowed), rows.probs).float()
    at = [pack.add(ids), pack.add(values), pack.add(tail), pack.add(error)]
    return lambda host: {
        "ids": host[at[0]].astype(np.int64),
        "probs": host[at[1]].astype(np.float32),
        "tail_mass": host[at[2]].astype(np.float32),
        "recon_error": host[at[3]].astype(np.float32),
    }


def _split(
    rows: _Rows,
    req: VerifyRequest,
    held: int,
    model_ms: float,
    numbers: _Numbers,
    need: dict[str, slice],
    pack: _Pack,
) -> Finish:
    """DSSD's worker half as ``workers.scoring._split``: the accept test, then the bonus or the row at the
    rejection — both computed, the host keeps the one the verdict names."""
    gamma, probs = len(req.draft), rows.probs
    draft = numbers[need["draft"]].long()
    if req.temperature == 0:  # accept while x_j is the argmax (ties to the lowest id), then emit the argmax
        targets = probs.argmax(dim=-1)
        accepted = torch.cumprod((targets[:gamma] == draft).long(), dim=0).sum()
        bonus = targets.index_select(0, accepted[None])[0]
    else:
        # normalised(probs) at the draft tokens, without its whole rows in float64
        p_draft = probs[torch.arange(gamma, device=probs.device), draft].double() / probs[
            :gamma
        ].double().sum(dim=-1).clamp(min=1e-300)
        accepted = count_accepts(numbers.u(need["u"]), acceptance_probs(p_draft, numbers[need["q"]]))
        bonus = sample_rows(probs[gamma:], numbers.u(need["bonus_u"]))[0]
    drawn = "residual_u" in need
    if drawn:
        # the bonus, or the token drawn from the residual at the rejection: both computed, the verdict picks
        bonus = torch.where(
            accepted == gamma, bonus, _residual_draw(probs, accepted.clamp(max=gamma - 1), numbers, need)
        )
    counts = pack.add(torch.stack([accepted, bonus]))
    rejected = (
        _distributions(rows.take(accepted.clamp(max=max(gamma - 1, 0))[None]), req, pack, None)
        if gamma and not drawn
        else None
    )
    logs = _split_logprobs(req, probs, draft, accepted, bonus, pack)

    def finish(host: _Pack) -> VerifyResponse:
        num_accepted, token = (int(v) for v in host[counts])
        if (num_accepted == gamma or drawn) and req.temperature > 0:
            rows.need_mass(host, num_accepted)
        asked = logs(host, num_accepted)
        if num_accepted == gamma or req.temperature == 0 or drawn:
            return VerifyResponse(
                held=held, num_accepted=num_accepted, bonus=token, model_ms=model_ms, **asked
            )
        assert rejected is not None
        return VerifyResponse(
            held=held,
            num_accepted=num_accepted,
            probs_dtype=req.probs_dtype,
            model_ms=model_ms,
            **rejected(host),
            **asked,
        )

    return finish


def _residual_draw(
    probs: torch.Tensor, row: torch.Tensor, numbers: _Numbers, need: dict[str, slice]
) -> torch.Tensor:
    """``workers.scoring.split_residual_draw`` as tensor ops at a device index ``row``, nothing read back: p
    as the gateway's ``mixture`` makes it, q̂ from the row's support (the other rows' entries add 0),
    norm(max(0, p − q̂)) (p where that has no mass), one draw with the gateway's RESIDUAL number."""
    p = torch.einsum(
        "n,nmv->mv",
        torch.ones(1, dtype=torch.float64, device=probs.device),
        normalised(probs.index_select(0, row[None]).double())[None],
    )[0]
    ids, row_of, q_values = (
        numbers[need["ids"]].long(),
        numbers[need["row_of"]].long(),
        numbers[need["support_q"]],
    )
    q = torch.zeros_like(p).index_put_(
        (ids,),
        torch.where(row_of == row, q_values, torch.zeros((), dtype=torch.float64, device=p.device)),
        accumulate=True,
    )
    diff = torch.clamp(p - q, min=0.0)
    total = diff.sum()
    residual = torch.where(total > 0, diff / total, p / p.sum())
    return sample_rows(residual[None], numbers.u(need["residual_u"]).index_select(0, row[None]))[0]


def _split_logprobs(
    req: VerifyRequest,
    probs: torch.Tensor,
    draft: torch.Tensor,
    accepted: torch.Tensor,
    bonus: torch.Tensor,
    pack: _Pack,
) -> Callable[[_Pack, int], dict[str, Any]]:
    if req.logprobs is None:
        return lambda host, num_accepted: {}
    gamma, norm = len(req.draft), normalised(probs)
    # the bonus's row by a device index (a 0-dim tensor as an index is read back: ``norm[accepted, bonus]``
    # waits for the device)
    picked = norm.index_select(0, accepted.reshape(1)).gather(1, bonus.reshape(1, 1)).reshape(1)
    at = [pack.add(_logs(norm[torch.arange(gamma, device=norm.device), draft])), pack.add(_logs(picked))]
    top = _top(probs, norm, req.logprobs, pack) if req.logprobs else None

    def asked(host: _Pack, num_accepted: int) -> dict[str, Any]:
        out: dict[str, Any] = {"draft_logprobs": host[at[0]].astype(np.float32)}
        if num_accepted == gamma or req.temperature == 0 or req.support_q is not None:
            # of ``bonus``: the bonus, or the token drawn at the rejection
            out["sample_logprobs"] = host[at[1]].astype(np.float32)
        if top is not None:
            out["top_ids"], out["top_logprobs"] = (
                host[top[0]].astype(np.int64),
                host[top[1]].astype(np.float32),
            )
        return out

    return asked


def _exact(
    rows: _Rows,
    req: VerifyRequest,
    held: int,
    model_ms: float,
    numbers: _Numbers,
    need: dict[str, slice],
    pack: _Pack,
) -> Finish:
    """As ``workers.scoring._exact``: per row p_n on S_j, the mass off it (summed directly), a sample from off
    it; the bonus (a tree: none)."""
    gamma, tree, probs = len(req.draft), req.parents is not None, rows.probs
    ids, row_of = numbers[need["ids"]].long(), numbers[need["row_of"]].long()
    count = int(np.asarray(req.support_sizes).size)
    outside = (
        probs[:count]
        .double()
        .index_put((row_of, ids), torch.zeros((), dtype=torch.float64, device=probs.device))
    )
    mass = outside.sum(dim=-1)
    samples = (
        torch.where(mass > 0, sample_rows(outside, numbers.u(need["u"])), -1)
        if count
        else torch.zeros(0, dtype=torch.long, device=probs.device)
    )
    # a tree's leaves hold theirs
    bonus = (
        torch.full((1,), -1, device=probs.device)
        if tree
        else sample_rows(probs[gamma:], numbers.u(need["bonus_u"]))
    )
    at = [pack.add(probs[row_of, ids]), pack.add(mass, wide=True), pack.add(samples), pack.add(bonus)]
    logs = None
    if req.logprobs is not None:
        norm = normalised(probs)
        own = torch.where(
            samples >= 0, norm[torch.arange(count, device=probs.device), samples.clamp(min=0)], 1.0
        )
        mine = own if tree else torch.cat([own, norm[gamma].gather(0, bonus)])
        logs = (pack.add(_logs(mine)), _top(probs, norm, req.logprobs, pack) if req.logprobs else None)

    def finish(host: _Pack) -> VerifyResponse:
        if not tree:
            rows.need_mass(host, gamma)
        asked: dict[str, Any] = {}
        if logs is not None:
            asked["sample_logprobs"] = host[logs[0]].astype(np.float32)
            if logs[1] is not None:
                asked["top_ids"], asked["top_logprobs"] = (
                    host[logs[1][0]].astype(np.int64),
                    host[logs[1][1]].astype(np.float32),
                )
        return VerifyResponse(
            held=held,
            support_probs=host[at[0]].astype(np.float32),
            complement=host[at[1]].astype(np.float64),
            complement_samples=host[at[2]].astype(np.int32),
            bonus=-1 if tree else int(host[at[3]][0]),
            model_ms=model_ms,
            **asked,
        )

    return finish


def _logs(probs: torch.Tensor) -> torch.Tensor:
    """Natural logs as f32, log 0 floored at log 1e-45 (as ``workers.scoring._logs``)."""
    return torch.log(probs.double().clamp(min=1e-45)).float()


def _top(probs: torch.Tensor, norm: torch.Tensor, n: int, pack: _Pack) -> tuple[int, int]:
    """The n most likely ids per row of ``norm`` (``probs`` normalised: the same order, ties included), ties
    to the lowest id."""
    _, ids = top_entries(probs, n)
    return pack.add(ids), pack.add(_logs(norm.gather(1, ids)))


@dataclass(frozen=True)
class DeviceScoring:
    """A kind of answer (workers.scoring.SCORINGS) scored where the logits are: ``numbers`` queues what the
    host reads or draws for a call into the step's one upload; ``score`` queues the call's device work and
    returns what builds its answer once the pack is on the host."""

    numbers: Callable[[VerifyRequest, _Numbers], dict[str, slice]]
    score: Callable[[_Rows, VerifyRequest, int, float, _Numbers, dict[str, slice], _Pack], Finish]


# by kind of answer, as workers.scoring.SCORINGS; a mode with a kind of its own adds its scoring here
DEVICE_SCORINGS: dict[str, DeviceScoring] = {
    ROWS: DeviceScoring(_no_numbers, _rows_call),
    SAMPLE: DeviceScoring(_sample_numbers, partial(_rows_call, sampled=True)),
    VERDICT: DeviceScoring(_verdict_numbers, _split),
    SPARSE: DeviceScoring(_sparse_numbers, _exact),
}


def _kind(req: VerifyRequest) -> DeviceScoring:
    return DEVICE_SCORINGS[scoring_of(req.mode, req.temperature > 0)]
