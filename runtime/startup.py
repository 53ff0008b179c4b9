"""What a replica's start reports beyond what its worker measures: code that runs in the enter hooks (the LLM
engine: KV cache, graph capture) adds its phases here, and the worker sends them with its ready line, so they show
in the start's breakdown (X-Ember-Start-Breakdown, `ember status`, the logs and /metrics)."""

phases: dict[str, int | str] = {}


def report(values: dict[str, int | str]) -> None:
    """Add to this replica's start breakdown: `name_ms` for a phase's milliseconds (summed in /metrics), or any short
    value (`gpu_image="reserved"`)."""
    phases.update(values)
