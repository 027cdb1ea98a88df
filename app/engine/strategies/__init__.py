"""The strategies by name, the name a mode's row gives (``core.modes.ModeSpec.strategy``): one per mode whose
rows they verify; a tree is verified on its payload's (``SpecOptions.verifier``). A mode registered elsewhere
adds its own here."""

from app.engine.strategies.aggregate import AggregateStrategy
from app.engine.strategies.autoregressive import AutoregressiveStrategy
from app.engine.strategies.base import LoopStrategy, RoundStrategy
from app.engine.strategies.exact import ExactStrategy
from app.engine.strategies.pipeline import PipelineStrategy
from app.engine.strategies.split import SplitStrategy
from core.errors import ConfigError
from core.modes import MODES
from core.names import Mode

STRATEGIES: dict[str, RoundStrategy | LoopStrategy] = {
    Mode.AUTOREGRESSIVE: AutoregressiveStrategy(),
    Mode.AGGREGATE: AggregateStrategy(),  # chains and trees on full or top-k rows
    Mode.SPLIT: SplitStrategy(),
    Mode.EXACT: ExactStrategy(),  # chains and trees on sparse rows
    # owns its loop: segments of a tree through stage workers (docs/design.md §3.7)
    Mode.PIPELINE: PipelineStrategy(),
}


def check_strategies() -> None:
    """Every served mode's strategy is here (a plug-in registers both): else a ConfigError at start-up, not a
    500 at its first request."""
    for mode, spec in MODES.items():
        if spec.strategy is not None and spec.strategy not in STRATEGIES:
            raise ConfigError(
                f"mode {str(mode)!r} names the strategy {spec.strategy!r}, which app.engine.strategies."
                "STRATEGIES lacks: register both"
            )


__all__ = ["STRATEGIES", "LoopStrategy", "RoundStrategy", "check_strategies"]
