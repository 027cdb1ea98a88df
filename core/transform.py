"""Transforms (docs/design.md §3.9), one definition for the draft and every worker: per row, min_tokens →
logit_bias → penalties → grammar mask, then ``core.math.sampling``. ``TransformSpec``: what a request asks;
``LogitsTransform``: one session's state."""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import numpy as np
import torch

from core.grammar import Grammars, GrammarSpec, Matcher
from core.runners.step_upload import Segment, StepUpload

MAX_BIAS = 100.0  # OpenAI: logit_bias values lie in [−100, 100]
MAX_PENALTY = 2.0  # OpenAI: presence / frequency penalties lie in [−2, 2]
MAX_REPETITION = 20.0  # vLLM's repetition_penalty: > 0; beyond this it only says "never repeat"
MIN_REPETITION = 0.01  # below it a positive logit ÷ the penalty can overflow fp32


@dataclass(frozen=True)
class TransformSpec:
    """What a request asks of the target's logits, beside the sampling parameters."""

    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added logit), ids ascending
    presence_penalty: float = 0.0  # subtracted once from every token generated so far
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    # vLLM's: logits of tokens in the prompt or output divided (> 0) or multiplied (≤ 0) by it
    repetition_penalty: float = 1.0
    grammar: GrammarSpec | None = None
    prompt_len: int = 0  # the generated part of a prefix starts here (penalties count it)
    min_tokens: int = 0  # vLLM's: ``eos_ids`` at −∞ in every row whose prefix holds fewer generated tokens
    eos_ids: tuple[int, ...] = ()  # what min_tokens keeps out: the gateway's EOS ids, ascending

    def __post_init__(self) -> None:
        if any(not -MAX_BIAS <= v <= MAX_BIAS for _, v in self.logit_bias):
            raise ValueError(f"logit_bias values must lie in [−{MAX_BIAS:g}, {MAX_BIAS:g}]")
        if len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
            # which one would win is the device's choice
            raise ValueError("logit_bias names a token id twice")
        if not (
            -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY
            and -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY
        ):
            raise ValueError(
                f"presence_penalty and frequency_penalty must lie in [−{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
            )
        if not MIN_REPETITION <= self.repetition_penalty <= MAX_REPETITION:
            raise ValueError(f"repetition_penalty must lie in [{MIN_REPETITION:g}, {MAX_REPETITION:g}]")
        if self.prompt_len < 0 or self.min_tokens < 0:
            raise ValueError("prompt_len and min_tokens must be ≥ 0")
        if any(t < 0 for t in self.eos_ids):
            raise ValueError("eos_ids are token ids ≥ 0")

    @property
    def is_identity(self) -> bool:
        return not self.logit_bias and not self.penalises and self.grammar is None and not self.suppresses

    @property
    def suppresses(self) -> bool:
        """min_tokens keeps EOS out of the first rows."""
        return self.min_tokens > 0 and bool(self.eos_ids)

    @property
    def penalises(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prompt_len": self.prompt_len}
        if self.logit_bias:
            out["logit_bias"] = [[t, v] for t, v in self.logit_bias]
        for name, off in (("presence_penalty", 0), ("frequency_penalty", 0), ("repetition_penalty", 1)):
            if getattr(self, name) != off:
                out[name] = getattr(self, name)
        if self.grammar is not None:
            out["grammar"] = self.grammar.to_wire()
        if self.suppresses:
            out["min_tokens"], out["eos_ids"] = self.min_tokens, list(self.eos_ids)
        return out

    @classmethod
    def from_wire(cls, value: Any) -> TransformSpec:
        """ValueError (naming the field) on anything malformed."""
        if not isinstance(value, dict):
            raise ValueError("transform must be an object")
        known = {f.name for f in fields(cls)}
        if set(value) - known:
            raise ValueError(f"transform has unknown fields {sorted(set(value) - known)}")
        try:
            bias = tuple(sorted((int(t), float(v)) for t, v in value.get("logit_bias", [])))
            grammar = GrammarSpec.from_wire(value["grammar"]) if "grammar" in value else None
            return cls(
                logit_bias=bias,
                presence_penalty=float(value.get("presence_penalty", 0.0)),
                frequency_penalty=float(value.get("frequency_penalty", 0.0)),
                repetition_penalty=float(value.get("repetition_penalty", 1.0)),
                grammar=grammar,
                prompt_len=int(value.get("prompt_len", 0)),
                min_tokens=int(value.get("min_tokens", 0)),
                eos_ids=tuple(sorted({int(t) for t in value.get("eos_ids", [])})),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"transform: {exc}") from exc


def penalise(
    logits: torch.Tensor,  # [V] one row's logits (biased)
    prompt: np.ndarray,  # [P] int: the prefix's prompt tokens (the repetition penalty counts them)
    generated: np.ndarray,  # [G] int: the prefix's generated tokens (every penalty counts them)
    spec: TransformSpec,
) -> torch.Tensor:  # [V]
    """vLLM's repetition penalty (prompt and generated tokens), then OpenAI's presence and frequency penalties
    (generated): §3.9's order."""
    out = logits.clone()
    if spec.repetition_penalty != 1:
        seen = torch.from_numpy(np.unique(np.concatenate([prompt, generated]).astype(np.int64)))
        values = out[seen]
        # a GPU divides by a host number as a product with its inverse
        penalty = torch.full((), spec.repetition_penalty, dtype=out.dtype, device=out.device)
        out[seen] = torch.where(values > 0, values / penalty, values * spec.repetition_penalty)
    if (spec.presence_penalty or spec.frequency_penalty) and len(generated):
        ids, counts = np.unique(generated.astype(np.int64), return_counts=True)
        ids_t = torch.from_numpy(ids)
        out[ids_t] -= (
            torch.from_numpy(counts).to(out.device, out.dtype) * spec.frequency_penalty
            + spec.presence_penalty
        )
    return out


def on_device(mask: torch.Tensor, device: torch.device) -> torch.Tensor:
    # [R, V] bool on the host -> on ``device``
    """A host mask where the logits are: packed 8 ids a byte for the copy (a step's grammar rows are R × V),
    unpacked there."""
    if device.type == "cpu":
        return mask
    packed = torch.from_numpy(np.packbits(mask.numpy(), axis=-1, bitorder="little"))
    return unpack_bits(packed.to(device), mask.shape[-1])


def unpack_bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    # [R, ⌈width / 8⌉] uint8 -> [R, width] bool
    """``np.packbits(..., bitorder="little")`` undone as tensor ops, where ``packed`` lies."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed[..., None] >> shifts) & 1).reshape(*packed.shape[:-1], -1)[..., :width].bool()


@dataclass
class LogitsTransform:
    """One session's transform: the spec, and a grammar matcher kept at the agreed tokens."""

    spec: TransformSpec
    vocab_size: int
    matcher: Matcher | None = None

    @classmethod
    def build(cls, spec: TransformSpec, vocab_size: int, grammars: Grammars | None) -> LogitsTransform:
        """GrammarError when the grammar does not compile; ValueError for a bias id off the vocabulary."""
        if any(not 0 <= t < vocab_size for t, _ in spec.logit_bias):
            raise ValueError(f"logit_bias names a token id outside [0, {vocab_size})")
        if any(t >= vocab_size for t in spec.eos_ids) or (spec.eos_ids and len(spec.eos_ids) >= vocab_size):
            raise ValueError(f"eos_ids must be ids in [0, {vocab_size}), not the whole vocabulary")
        matcher = None
        if spec.grammar is not None:
            if grammars is None:
                raise ValueError("this side has no grammar engine")
            matcher = grammars.compile(spec.grammar).matcher()
        return cls(spec, vocab_size, matcher)

    def rows(
        self,
        logits: torch.Tensor,  # [R, V]: a model's logits at R rows
        agreed: list[int],  # the tokens every row's prefix starts with (prompt + generated so far)
        # [R]: each row's tokens after ``agreed`` (a chain's draft[:j], a node's path)
        paths: list[list[int]],
    ) -> torch.Tensor:  # [R, V] fp32, transformed
        """Every row's logits transformed by its own prefix (docs/design.md §3.9); leaves the matcher at
        ``agreed``, which holds the whole prompt."""
        if len(agreed) < self.spec.prompt_len:
            raise ValueError(
                f"the rows' common prefix ({len(agreed)} tokens) is shorter than the prompt "
                f"({self.spec.prompt_len})"
            )
        out = logits.float().clone()
        if self.spec.suppresses:
            # min_tokens, first (vLLM's order): before bias, penalties, min-p, top-k and top-p
            self._suppress_eos(out, agreed, paths, float("-inf"))
        if self.spec.logit_bias:
            ids, values = self._bias
            out[:, ids.to(out.device)] += values.to(out.device)
        if self.spec.penalises:
            base = np.asarray(agreed, dtype=np.int64)
            prompt, generated = base[: self.spec.prompt_len], base[self.spec.prompt_len :]
            for r, path in enumerate(paths):
                out[r] = penalise(
                    out[r], prompt, np.concatenate([generated, np.asarray(path, dtype=np.int64)]), self.spec
                )
        if self.matcher is not None:
            out.masked_fill_(~on_device(self.masks(agreed, paths), out.device), float("-inf"))
        return out

    def device_plan(self, agreed: list[int], paths: list[list[int]], upload: StepUpload) -> DeviceTransform:
        """``rows`` for a step whose rows are on a device: everything the host knows of it (EOS rows, bias,
        each row's penalised ids, the grammar's masks packed 8 ids a byte) queued in the step's upload now,
        before its forward; ``DeviceTransform.apply`` then transforms the rows where they are, reading nothing
        back. The same numbers as ``rows``."""
        if len(agreed) < self.spec.prompt_len:
            raise ValueError(
                f"the rows' common prefix ({len(agreed)} tokens) is shorter than the prompt "
                f"({self.spec.prompt_len})"
            )
        spec, count = self.spec, len(paths)
        plan = DeviceTransform(spec, count, self.vocab_size, upload)
        if spec.suppresses:
            plan.eos = (
                upload.add(np.asarray(self._early_rows(agreed, paths), dtype=np.int64)),
                upload.add(np.asarray(spec.eos_ids, dtype=np.int64)),
            )
        if spec.logit_bias:
            ids, values = self._bias
            plan.bias = (upload.add(ids.numpy()), upload.add(values.double().numpy()))
        if spec.penalises:
            plan.penalties = self._penalty_plan(agreed, paths, upload)
        if self.matcher is not None:
            plan.grammar = upload.add(
                np.packbits(self.masks(agreed, paths).numpy(), axis=-1, bitorder="little")
            )
        return plan

    def _penalty_plan(
        self, agreed: list[int], paths: list[list[int]], upload: StepUpload
    ) -> tuple[Segment, ...]:
        """Per row, the ids ``penalise`` touches: the ones seen (repetition) and the generated ones with their
        counts."""
        spec = self.spec
        base = np.asarray(agreed, dtype=np.int64)
        prompt, generated = base[: spec.prompt_len], base[spec.prompt_len :]
        seen_rows, seen_ids, count_rows, count_ids, counts = [], [], [], [], []
        for r, path in enumerate(paths):
            mine = np.concatenate([generated, np.asarray(path, dtype=np.int64)])
            if spec.repetition_penalty != 1:
                seen = np.unique(np.concatenate([prompt, mine]))
                seen_rows.append(np.full(seen.size, r))
                seen_ids.append(seen)
            if (spec.presence_penalty or spec.frequency_penalty) and len(mine):
                ids, times = np.unique(mine, return_counts=True)
                count_rows.append(np.full(ids.size, r))
                count_ids.append(ids)
                counts.append(times)
        flat = lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)  # noqa: E731
        return tuple(
            upload.add(flat(parts)) for parts in (seen_rows, seen_ids, count_rows, count_ids, counts)
        )

    @property
    def masks_any(self) -> bool:
        """Some row may have ids at −∞ (a grammar, min_tokens): ``masks`` says which."""
        return self.matcher is not None or self.spec.suppresses

    def masks(self, agreed: list[int], paths: list[list[int]]) -> torch.Tensor:  # [R, V] bool
        """The ids each row may emit: the grammar's allowed set after its prefix, less EOS where min_tokens
        keeps it out."""
        out = torch.ones(len(paths), self.vocab_size, dtype=torch.bool)
        if self.matcher is not None:
            matcher = self.matcher
            matcher.sync(self._generated(agreed))
            for r, path in enumerate(paths):
                for token in path:
                    matcher.consume(token)
                out[r] = matcher.allowed()
                matcher.rollback(len(path))
        if self.spec.suppresses:
            self._suppress_eos(out, agreed, paths, False)
        return out

    def _suppress_eos(
        self, out: torch.Tensor, agreed: list[int], paths: list[list[int]], value: float | bool
    ) -> None:
        """Set EOS to ``value`` in the rows whose prefix holds fewer than min_tokens generated tokens."""
        early = self._early_rows(agreed, paths)
        if early:
            out[torch.tensor(early)[:, None], torch.tensor(self.spec.eos_ids)[None, :]] = value

    def _early_rows(self, agreed: list[int], paths: list[list[int]]) -> list[int]:
        generated = len(agreed) - self.spec.prompt_len
        return [r for r, path in enumerate(paths) if generated + len(path) < self.spec.min_tokens]

    def forced(self, agreed: list[int]) -> int | None:
        """The one token the grammar allows after ``agreed``, if only one; several end tokens are not forced
        (each target weighs them its own way)."""
        if self.matcher is None:
            return None
        self.matcher.sync(self._generated(agreed))
        allowed = self.matcher.allowed().nonzero()[:, 0].tolist()
        return int(allowed[0]) if len(allowed) == 1 else None

    def forced_run(
        self, agreed: list[int], most: int, eos_ids: set[int] | frozenset[int] = frozenset()
    ) -> list[int]:
        """Up to ``most`` tokens forced one after another after ``agreed`` (an EOS ends it): a point mass for
        every model, so exact."""
        out: list[int] = []
        while len(out) < most:
            token = self.forced([*agreed, *out])
            if token is None:
                break
            out.append(token)
            if token in eos_ids:
                break
        return out

    def _generated(self, agreed: list[int]) -> list[int]:
        return list(agreed[self.spec.prompt_len :])

    @cached_property
    def _bias(self) -> tuple[torch.Tensor, torch.Tensor]:  # [b] long ids, [b] fp32 values
        return torch.tensor([t for t, _ in self.spec.logit_bias], dtype=torch.long), torch.tensor(
            [v for _, v in self.spec.logit_bias], dtype=torch.float32
        )


@dataclass
class DeviceTransform:
    """A call's transform as numbers in its step's upload (``LogitsTransform.device_plan``); ``apply`` after
    the upload is sent."""

    spec: TransformSpec
    rows: int
    vocab_size: int
    upload: StepUpload
    eos: tuple[Segment, Segment] | None = None  # the early rows, the EOS ids
    bias: tuple[Segment, Segment] | None = None  # ids, values (float32's, as float64)
    penalties: tuple[Segment, ...] | None = None  # seen (rows, ids), counted (rows, ids, counts)
    grammar: Segment | None = None  # [rows, ⌈V / 8⌉] packed allowed ids

    def apply(self, logits: torch.Tensor) -> torch.Tensor:  # [rows, V] -> [rows, V] fp32, transformed
        """``LogitsTransform.rows`` where ``logits`` are, in its order: min_tokens, bias, penalties, the
        grammar's mask."""
        view, spec = self.upload.view, self.spec
        out = logits.float().clone()
        if self.eos is not None:
            # the value made where the rows are: a Python number set by an index is copied in from the host
            early, eos = view(self.eos[0]), view(self.eos[1])
            out.index_put_((early[:, None], eos[None, :]), torch.full((), float("-inf"), device=out.device))
        if self.bias is not None:
            ids = view(self.bias[0])
            out[:, ids] += view(self.bias[1]).float()
        if self.penalties is not None:
            seen_rows, seen_ids, count_rows, count_ids, counts = (view(segment) for segment in self.penalties)
            if spec.repetition_penalty != 1:
                # divided by a tensor: a GPU divides by a host number as a product with its inverse
                values = out[seen_rows, seen_ids]
                penalty = torch.full((), spec.repetition_penalty, dtype=out.dtype, device=out.device)
                out[seen_rows, seen_ids] = torch.where(
                    values > 0, values / penalty, values * spec.repetition_penalty
                )
            if spec.presence_penalty or spec.frequency_penalty:
                out[count_rows, count_ids] -= (
                    counts.to(out.dtype) * spec.frequency_penalty + spec.presence_penalty
                )
        if self.grammar is not None:
            out.masked_fill_(~unpack_bits(view(self.grammar), self.vocab_size), float("-inf"))
        return out
