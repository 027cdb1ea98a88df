"""The strategies, one per served mode (``core.modes`` says what each takes and needs)."""

from app.engine.strategies.aggregate import AggregateStrategy
from app.engine.strategies.autoregressive import AutoregressiveStrategy
from app.engine.strategies.base import Strategy
from app.engine.strategies.exact import ExactStrategy
from app.engine.strategies.pipeline import PipelineStrategy
from app.engine.strategies.split import SplitStrategy
from app.engine.strategies.tree import TreeStrategy
from core.names import Mode

STRATEGIES: dict[Mode, Strategy] = {
    Mode.AUTOREGRESSIVE: AutoregressiveStrategy(),
    Mode.AGGREGATE: AggregateStrategy(),
    Mode.SPLIT: SplitStrategy(),
    Mode.EXACT: ExactStrategy(),
    Mode.TREE: TreeStrategy(),  # a row per node on aggregate's or exact's payload (DESIGN §3.6)
    Mode.PIPELINE: PipelineStrategy(),  # owns its loop: segments of a tree through stage workers (DESIGN §3.7)
}
