"""Everything one worker app owns (docs/design.md §4); its step is ``workers.step`` (a stage's:
``workers.stage``), its sessions and their transforms ``workers.sessions``."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

from core.grammar import engine_version
from core.modes import verify_modes
from core.protocol import PROTOCOL_VERSION, InfoResponse
from core.runners import ModelRunner
from core.runners.model_thread import ModelThread
from workers.link import StageLink
from workers.scheduler import VerifyScheduler
from workers.sessions import SessionStore
from workers.settings import WorkerSettings, prefill_chunk
from workers.stage import StageOrder
from workers.step import Steps


@dataclass
class WorkerState:
    """Everything one worker app owns; built by ``create_app``, never a module global. Its parts are objects,
    each handed what it needs: ``steps`` (what the scheduler runs: each session's transform, a pipeline
    stage's side), the scheduler, the link."""

    settings: WorkerSettings
    runner: ModelRunner
    sessions: SessionStore
    thread: ModelThread = field(default_factory=ModelThread)  # every runner call (core.runners.model_thread)
    # see _WorkerCollector
    counters: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    errors: Counter[str] = field(default_factory=Counter)  # refused calls, by error code
    in_flight: int = 0  # verify and stage calls being answered (workers.server._counted)
    # a stage: each session's messages in seq order
    order: StageOrder = field(default_factory=lambda: StageOrder())
    steps: Steps = field(init=False)
    scheduler: VerifyScheduler = field(init=False)  # every call that touches the runner, in steps
    link: StageLink = field(init=False)  # a stage: to the next stage

    def __post_init__(self) -> None:
        scoring = self.settings.scoring
        on_gpu = getattr(self.runner, "device", None) is not None and self.runner.device.type == "cuda"  # type: ignore[attr-defined]
        on_device = not self.is_stage and (scoring == "device" or (scoring == "auto" and on_gpu))
        self.runner.logits_on_device = on_device
        self.steps = Steps(self.settings, self.runner, self.sessions, self.counters, self.thread, on_device)
        self.scheduler = VerifyScheduler(
            self.steps, self.settings.max_batch_tokens, prefill_chunk(self.settings)
        )
        self.link = StageLink(self.settings, self.runner.info.vocab_size)

    def is_idle(self) -> bool:
        """No call in flight and no session held: a draining worker may leave."""
        return self.in_flight == 0 and len(self.sessions) == 0

    @property
    def is_stage(self) -> bool:
        return self.runner.layer_range is not None

    @classmethod
    def build(
        cls, settings: WorkerSettings, runner: ModelRunner, thread: ModelThread | None = None
    ) -> WorkerState:
        sessions = SessionStore(
            runner,
            settings.max_sessions,
            settings.session_ttl_s,
            settings.memory_cap_mb * 2**20,
            settings.session_live_s,
        )
        return cls(settings=settings, runner=runner, sessions=sessions, thread=thread or ModelThread())

    def info(self) -> InfoResponse:
        info = self.runner.info
        return InfoResponse(
            protocol_version=PROTOCOL_VERSION,
            modes=[str(m) for m in verify_modes()],
            model_id=info.model_id,
            vocab_size=info.vocab_size,
            tokenizer_fingerprint=self.runner.fingerprint,
            eos_ids=info.eos_ids,
            max_context=self.steps.stage.max_context,
            backend=info.backend,
            layer_range=list(self.runner.layer_range) if self.runner.layer_range is not None else None,
            num_layers=self.runner.num_layers,
            grammar_engine=engine_version(),
            max_grammar_bytes=self.settings.max_grammar_bytes,
            step={
                **self.runner.step_info(),
                "scoring": "device" if self.steps.scores_on_device else "host",
                "decode_ahead": self.steps.looks_ahead,
            },
        )
