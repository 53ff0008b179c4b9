"""The engine's step counters by kind, as /metrics shows them (tests/runtime/engine/test_api.py reads them served)."""
from ember.runtime.engine.block_manager import BlockManager
from ember.runtime.engine.metrics import render
from ember.runtime.engine.model_runner import RunOutput
from ember.runtime.engine.observer import EngineObserver, StepRecord
from ember.runtime.engine.scheduler import ScheduledBatch, Scheduler


def test_steps_are_counted_by_kind_with_their_device_seconds():
    """A decode graph replayed, a prefill through the piecewise graphs and an eager step each count as their own kind:
    a prefill replayed from piecewise graphs counted as eager hid whether a replica's prefills used them."""
    observer = EngineObserver(Scheduler(BlockManager(16, 16), 8, 256), "m")

    def step(graph: int | None, piecewise: int | None, gpu: float) -> None:
        run = RunOutput([], [], 0.001, 0.002, gpu, graph, piecewise)
        observer.stepped(StepRecord(ScheduledBatch(), run, [], 0.0, 0.003))

    step(8, None, 0.004)
    step(None, 256, 0.010)
    step(None, 256, 0.012)
    step(None, None, 0.050)
    assert observer.stats.steps == {"graph": 1, "piecewise": 2, "eager": 1}
    assert observer.stats.step_device_seconds["piecewise"] == 0.022
    text = render(observer.stats, "m")
    assert 'ember:engine_steps_total{model_name="m",kind="piecewise"} 2' in text
    assert 'ember:engine_step_device_seconds_total{model_name="m",kind="eager"} 0.05' in text
