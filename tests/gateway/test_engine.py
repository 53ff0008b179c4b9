"""Engine series at the gateway (gateway/engine.py): two replicas' real /metrics endpoints (aiohttp servers on
loopback) scraped and summed per function; counts of a replica that goes away stay in the totals."""
import asyncio
from pathlib import Path
from types import SimpleNamespace

import aiohttp
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from ember.gateway.engine import EngineSeries, parse
from ember.gateway.replica import GatewayReplica


def exposition(success: int, running: int, kv: float, ttft: tuple[int, int, int]) -> str:
    """What one engine's /metrics says (runtime/engine/metrics.py's shape), with its own labels."""
    label = 'model_name="m"'
    return "\n".join([
        "# HELP ember:num_requests_running Requests in the running batch.", "# TYPE ember:num_requests_running gauge",
        f"ember:num_requests_running{{{label}}} {running}",
        "# TYPE ember:kv_cache_usage_perc gauge", f"ember:kv_cache_usage_perc{{{label}}} {kv}",
        "# TYPE ember:request_success counter",
        f'ember:request_success_total{{{label},finished_reason="stop"}} {success}',
        "# TYPE ember:time_to_first_token_seconds histogram",
        f'ember:time_to_first_token_seconds_bucket{{{label},le="0.1"}} {ttft[0]}',
        f'ember:time_to_first_token_seconds_bucket{{{label},le="10.0"}} {ttft[1]}',
        f'ember:time_to_first_token_seconds_bucket{{{label},le="+Inf"}} {ttft[2]}',
        f"ember:time_to_first_token_seconds_sum{{{label}}} 1.5",
        f"ember:time_to_first_token_seconds_count{{{label}}} {ttft[2]}",
        "python_gc_objects_collected_total 12",  # not the engine's: left out
    ]) + "\n"


async def serve_text(texts: list[str]) -> tuple[list[web.AppRunner], list[int]]:
    def metrics(text: str):
        async def handler(request: web.Request) -> web.Response:
            return web.Response(text=text, content_type="text/plain")
        return handler

    runners, ports = [], []
    for text in texts:
        app = web.Application()
        app.router.add_get("/metrics", metrics(text))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        ports.append(runner.addresses[0][1])
    return runners, ports


def value(lines: list[str], prefix: str) -> float:
    found = [line for line in lines if line.startswith(prefix)]
    assert len(found) == 1, (prefix, found)
    return float(found[0].rsplit(" ", 1)[1])


def test_engine_series_are_summed_per_function_and_survive_a_replica_leaving(tmp_path: Path):
    async def scenario():
        runners, ports = await serve_text([exposition(3, 1, 0.2, (1, 3, 3)), exposition(5, 2, 0.6, (2, 4, 5))])
        replicas = {}
        for i, port in enumerate(ports):
            replica = GatewayReplica(f"chat-{i}", "chat", "Chat", tmp_path / f"{i}.log", port=port)
            replica.ready()
            replicas[replica.id] = replica
        unit = SimpleNamespace(app="chat", name="Chat", asgi=True, router=SimpleNamespace(replicas=replicas))
        deployments = {"chat": SimpleNamespace(units={"Chat": unit})}
        series = EngineSeries()
        async with aiohttp.ClientSession() as client:
            await series.refresh(client, deployments)
            both = series.render()
            del replicas["chat-1"]  # scaled down: its counts must stay in the function's totals
            series.scraped_at = 0.0
            await series.refresh(client, deployments)
            one = series.render()
        for runner in runners:
            await runner.cleanup()
        return both, one

    both, one = asyncio.run(scenario())
    labels = 'app="chat",function="Chat"'
    assert value(both, f'ember:request_success_total{{{labels},finished_reason="stop",model_name="m"}}') == 8
    assert value(both, f'ember:num_requests_running{{{labels},model_name="m"}}') == 3  # gauges add up...
    assert value(both, f'ember:kv_cache_usage_perc{{{labels},model_name="m"}}') == 0.4  # ...fractions average
    assert [value(both, f'ember:time_to_first_token_seconds_bucket{{{labels},le="{le}",model_name="m"}}')
            for le in ("0.1", "10.0", "+Inf")] == [3, 7, 8]
    assert not any("python_gc" in line for line in both)
    families = {f.name: f.type for f in text_string_to_metric_families("\n".join(both) + "\n")}
    assert families["ember:time_to_first_token_seconds"] == "histogram"
    assert families["ember:request_success"] == "counter"
    bucket_lines = [line for line in both if "_bucket" in line]
    assert [line.split('le="')[1].split('"')[0] for line in bucket_lines] == ["0.1", "10.0", "+Inf"]  # in order

    assert value(one, f'ember:request_success_total{{{labels},finished_reason="stop",model_name="m"}}') == 8
    assert value(one, f'ember:time_to_first_token_seconds_count{{{labels},model_name="m"}}') == 8
    assert value(one, f'ember:num_requests_running{{{labels},model_name="m"}}') == 1  # only the live replica runs
    assert value(one, f'ember:kv_cache_usage_perc{{{labels},model_name="m"}}') == 0.2


def test_parse_reads_only_the_engine_series():
    kinds, values = parse('# TYPE ember:x counter\nember:x_total{a="1",b="q\\"uote"} 4\nother 1\nember:bad{} nan-ish\n')
    assert kinds == {"ember:x": "counter"}
    assert values == {("ember:x_total", (("a", "1"), ("b", 'q\\"uote'))): 4.0}
