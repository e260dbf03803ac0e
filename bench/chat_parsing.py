"""The cost of tool and reasoning parsing and penalties on streamed chat: output tok/s of N
concurrent streamed /v1/chat/completions requests with them on (tools with `tool_choice: auto`,
the qwen3 reasoning parser, every output a reasoning block and two tool calls, and
`repetition_penalty` 1.1, `frequency_penalty` 0.5, `presence_penalty` 0.3 applied by the
sampler) and off (the same requests with `tool_choice: none`, `--reasoning-parser none` and no
penalties), on one server (the tiny
Qwen3-MoE test checkpoint with the Qwen3 test template; the outputs are forced by
`tests/scripted_core.py`, so both runs generate the same tokens).

    PYTHONPATH=$PWD:tests python bench/chat_parsing.py [--streams 64] [--rounds 3]

Prints tok/s per round of each mode (alternating), the ratio of the medians, and the CPU time
per output token of the front end (this process: HTTP server, parsers, and the benchmark's own
clients) and of the engine core (its child process: model, sampler, penalties), which a
shared machine's other work disturbs less than wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

OUTPUT = ("<think>\n" + "Let me think about the weather in Paris and the time. " * 5
          + "\n</think>\n\nI will check both.\n<tool_call>\n"
          '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "set_alarm", "arguments": {"hour": 7, "on": true}}\n'
          "</tool_call>")
#: Sampling fields applied batched in the sampler (issue 44's cost budget includes them).
PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.3}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer"}}}}},
]


async def one_round(client, streams: int, parse: bool) -> float:
    from http_helpers import MODEL
    from scripted_core import END, START

    extra = {"extra_body": PENALTIES} if parse else {"tool_choice": "none"}

    async def run() -> int:
        tokens = 0
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{START}{OUTPUT}{END}"}],
            tools=TOOLS, max_tokens=300, stream=True,
            stream_options={"include_usage": True}, **extra)
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    cpu_before = cpu_seconds()
    start = time.perf_counter()
    counts = await asyncio.gather(*(run() for _ in range(streams)))
    wall = time.perf_counter() - start
    cpu = [after - before for after, before in zip(cpu_seconds(), cpu_before, strict=True)]
    return sum(counts) / wall, [1e3 * c / sum(counts) for c in cpu]


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) so far of this process (the HTTP front end, its parsers and
    the benchmark's clients) and of its children (the engine core: model, sampler,
    penalties); less sensitive than wall time to other work on a shared machine."""
    import psutil

    me = psutil.Process()
    own = me.cpu_times()
    children = 0.0
    for child in me.children(recursive=True):
        try:
            t = child.cpu_times()
            children += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return own.user + own.system, children


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import openai
    from chat_fixtures import family_checkpoint
    from fixtures import make_tiny_checkpoint
    from http_helpers import API_KEY
    from scripted_core import start_scripted_server

    from moe_engine.server.http.state import ChatSettings

    root = Path(tempfile.mkdtemp())
    ckpt = family_checkpoint(make_tiny_checkpoint("qwen3_moe", root), root, "qwen3")
    server = start_scripted_server(ckpt, num_blocks=4096, max_num_seqs=64,
                                   max_num_batched_tokens=4096)
    state = server.server.http_state
    on = state.chat
    off = ChatSettings(on.chat_template, on.tool_parser, None, True)
    url = f"http://127.0.0.1:{server.server.http_port}/v1"
    results: dict[str, list[float]] = {"parsers on": [], "parsers off": []}
    cpu_ms: dict[str, list[list[float]]] = {"parsers on": [], "parsers off": []}

    async def bench() -> None:
        client = openai.AsyncOpenAI(base_url=url, api_key=API_KEY, max_retries=0, timeout=600)
        state.chat = on
        await one_round(client, args.streams, True)  # warm-up
        await one_round(client, args.streams, False)
        for _ in range(args.rounds):
            for name, parse in (("parsers off", False), ("parsers on", True)):
                state.chat = on if parse else off
                rate, cpu = await one_round(client, args.streams, parse)
                results[name].append(rate)
                cpu_ms[name].append(cpu)
                print(f"{name}: {rate:.0f} tok/s, CPU ms per output token: front end "
                      f"{cpu[0]:.3f}, engine core {cpu[1]:.3f}", flush=True)
        await client.close()

    try:
        asyncio.run(bench())
    finally:
        server.close()
    ratio = statistics.median(results["parsers on"]) / statistics.median(results["parsers off"])
    print(f"median on/off: {ratio:.3f} ({args.streams} streams, {args.rounds} rounds)")
    for name, rows in cpu_ms.items():
        front, core = (statistics.median(col) for col in zip(*rows, strict=True))
        print(f"{name}: median CPU ms per output token: front end {front:.3f}, engine core "
              f"{core:.3f}, both {front + core:.3f}")
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
