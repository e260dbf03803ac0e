"""Runs the reference workload through llama.cpp, driven by `bench/throughput.py`.

Executed by the python of llama.cpp's own venv (`bench/setup_llamacpp.sh`), never imported by
the project: it needs only the standard library, numpy and the `llama_cpp` package's low-level
ctypes bindings (`llama_cpp.llama_cpp`), which load the shared library in `--lib-dir` (set as
LLAMA_CPP_LIB_PATH before the import). The model is one GGUF (`bench/llamacpp_gguf.py`); token
ids go in as they are (the GGUF's tokenizer is never used) and every token is chosen here by
argmax over the logits (greedy; no EOS check, so each request gets exactly its output_len).

Two modes, both timed around the decoding alone (the model and both contexts are made before
"ready"):
  - batched (default): ALL requests at once in one context with `n_seq_max` = number of
    requests, one sequence id per request (given out longest output first, `seq_order`):
    every prompt is prefilled through `llama_batch`es of up to `--n-batch` tokens (prompts
    packed back to back, logits only at each prompt's last token), then each step decodes one
    token of every unfinished request in one batch; a finished request's cells are freed;
  - batch1: each of the first `num_requests` (default 8) requests alone, one after another, in
    a context of one sequence (prefill, then one token per `llama_decode`); seconds = total.

Protocol, one JSON object per line; this process writes to its original stdout only protocol
lines (llama.cpp's log lines at WARN and above, and everything else printed, go to stderr):
  - once loaded: `{"event": "ready", "llama_cpp_python_version", "gguf", "load_s",
    "num_requests", "config", "system_info"}`;
  - per `{"cmd": "run"}` read on stdin, optional `"mode": "batch1"` (+ `"num_requests": n`,
    and `"output_len": m` to give each of them m tokens instead of its own) and
    `"return_token_ids": true`: `{"event": "run", "mode", "seconds", "output_tokens",
    "token_ids"?}`;
  - per `{"cmd": "logprobs", "prompts": [[int, ...], ...], "token_ids": [[int, ...], ...]}`:
    each prompt alone in the batch-1 context, and the log-softmax (float64, over the whole
    vocabulary) of the logits after its last token at the given token ids:
    `{"event": "logprobs", "argmax": [int, ...], "logprobs": [[float, ...], ...]}`;
  - `{"cmd": "quit"}` or end of stdin: exits 0;
  - on any failure: `{"event": "error", "error": "Type: message"}`, exit status 1.

    bench/.venvs/llamacpp/venv/bin/python bench/llamacpp_runner.py --model model-f32.gguf \
        --requests REQS.json --lib-dir bench/.venvs/llamacpp/build/bin --threads 2

REQS.json: a list of `{"prompt_token_ids": [int, ...], "output_len": int}`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from typing import Any, TextIO

import numpy as np
from runner_io import run_commands, run_runner, send  # bench/, beside this script

#: ggml_type ids of the KV cache types offered (ggml.h `enum ggml_type`).
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8, "bf16": 30}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
#: llama.cpp's KV cache is padded to this many cells per sequence.
KV_PAD = 256




class TokenBatch:
    """A `llama_batch` over numpy arrays this object owns (one sequence id per token).

    `fill(tokens, positions, seq_ids, logits)` takes int arrays of equal length <= capacity
    (logits: 0/1 per token, 1 = return that position's logits).
    """

    def __init__(self, ll: Any, capacity: int):
        self.ll = ll
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.seq = np.zeros(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        # seq_id[i] -> &seq[i]: an array of pointers into `seq`.
        self.seq_ptrs = (self.seq.ctypes.data + 4 * np.arange(capacity)).astype(np.uintp)
        self.batch = ll.llama_batch()
        b = self.batch
        b.token = self.token.ctypes.data_as(ctypes.POINTER(ll.llama_token))
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(ll.llama_pos))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self.seq_ptrs.ctypes.data,
                               ctypes.POINTER(ctypes.POINTER(ll.llama_seq_id)))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def decode(self, ctx: Any, tokens, positions, seq_ids, logits, n_vocab: int) -> np.ndarray:
        """Decode the tokens; returns the greedy token of every position with logits=1, in
        batch order, as an int array.

        Raises:
            RuntimeError: llama_decode returned non-zero.
        """
        return self.decode_logits(ctx, tokens, positions, seq_ids, logits, n_vocab).argmax(axis=1)

    def decode_logits(self, ctx: Any, tokens, positions, seq_ids, logits, n_vocab: int
                      ) -> np.ndarray:
        """Decode the tokens; returns the logits rows (float32 [positions with logits=1,
        n_vocab], a view of llama.cpp's buffer, valid until the next decode).

        Raises:
            RuntimeError: llama_decode returned non-zero.
        """
        n = len(tokens)
        self.token[:n], self.pos[:n], self.seq[:n], self.logits[:n] = (
            tokens, positions, seq_ids, logits)
        self.batch.n_tokens = n
        rc = self.ll.llama_decode(ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {n} tokens")
        n_out = int(np.count_nonzero(self.logits[:n]))
        if n_out == 0:
            return np.zeros((0, n_vocab), np.float32)
        return np.ctypeslib.as_array(self.ll.llama_get_logits(ctx), shape=(n_out, n_vocab))


class Engine:
    """One model and its contexts; `run_batched` / `run_batch1` generate greedily."""

    def __init__(self, ll: Any, args: argparse.Namespace, requests: list[dict]):
        self.ll, self.args, self.requests = ll, args, requests
        mparams = ll.llama_model_default_params()
        mparams.n_gpu_layers = 0
        # Extra buffer types: ggml-cpu's AMX and repacked (interleaved) weight layouts.
        mparams.use_extra_bufts = args.extra_bufts == "on"
        self.model = ll.llama_model_load_from_file(args.model.encode(), mparams)
        if not self.model:
            raise RuntimeError(f"llama_model_load_from_file({args.model}) failed")
        self.n_vocab = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        longest = max(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
        self.seq_cells = -(-longest // KV_PAD) * KV_PAD
        n = len(requests)
        if args.kv_unified:
            total = sum(len(r["prompt_token_ids"]) + r["output_len"] for r in requests)
            n_ctx = -(-total // KV_PAD) * KV_PAD
        else:
            n_ctx = n * self.seq_cells
        self.ctx = self._context(n_ctx, n)
        self.ctx1 = self._context(self.seq_cells, 1)
        self.batch = TokenBatch(ll, max(args.n_batch, n))

    def _context(self, n_ctx: int, n_seq: int) -> Any:
        ll, a = self.ll, self.args
        p = ll.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, a.n_batch, a.n_ubatch, n_seq
        p.n_threads, p.n_threads_batch = a.threads, a.threads_batch or a.threads
        p.flash_attn_type = FLASH_ATTN[a.flash_attn]
        p.type_k, p.type_v = KV_TYPES[a.type_k], KV_TYPES[a.type_v]
        p.kv_unified = a.kv_unified
        p.no_perf = True
        ctx = ll.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError(f"llama_init_from_model(n_ctx={n_ctx}, n_seq_max={n_seq}) failed")
        return ctx

    def config(self) -> dict:
        a = self.args
        return {"threads": a.threads, "threads_batch": a.threads_batch or a.threads,
                "n_batch": a.n_batch, "n_ubatch": a.n_ubatch, "flash_attn": a.flash_attn,
                "type_k": a.type_k, "type_v": a.type_v, "kv_unified": a.kv_unified,
                "seq_order": a.seq_order, "extra_bufts": a.extra_bufts,
                "n_ctx": self.ll.llama_n_ctx(self.ctx), "n_seq_max": len(self.requests),
                "n_vocab": self.n_vocab}

    def _prefill(self, ctx: Any, reqs: list[dict], seq_ids: list[int]) -> list[int]:
        """Prompts packed into batches of <= n_batch tokens; the first greedy token of each."""
        tokens = np.concatenate([r["prompt_token_ids"] for r in reqs]).astype(np.int32)
        pos = np.concatenate([np.arange(len(r["prompt_token_ids"])) for r in reqs])
        seq = np.concatenate([np.full(len(r["prompt_token_ids"]), s)
                              for r, s in zip(reqs, seq_ids, strict=True)])
        last = np.zeros(len(tokens), np.int8)
        last[np.cumsum([len(r["prompt_token_ids"]) for r in reqs]) - 1] = 1
        first: list[int] = []
        step = self.args.n_batch
        for i in range(0, len(tokens), step):
            sl = slice(i, i + step)
            first += self.batch.decode(ctx, tokens[sl], pos[sl], seq[sl], last[sl],
                                       self.n_vocab).tolist()
        return first

    def _generate(self, ctx: Any, reqs: list[dict], seq_ids: list[int]) -> list[list[int]]:
        """Greedy generation of every request of `reqs` at once in `ctx` (empty memory)."""
        mem = self.ll.llama_get_memory(ctx)
        out = [[t] for t in self._prefill(ctx, reqs, seq_ids)]
        prompt_len = [len(r["prompt_token_ids"]) for r in reqs]
        active = [i for i, r in enumerate(reqs) if r["output_len"] > 1]
        for i, r in enumerate(reqs):
            if r["output_len"] <= 1:
                self.ll.llama_memory_seq_rm(mem, seq_ids[i], -1, -1)
        while active:
            tokens = [out[i][-1] for i in active]
            pos = [prompt_len[i] + len(out[i]) - 1 for i in active]
            seq = [seq_ids[i] for i in active]
            nxt = self.batch.decode(ctx, tokens, pos, seq, np.ones(len(active), np.int8),
                                    self.n_vocab)
            still = []
            for i, t in zip(active, nxt.tolist(), strict=True):
                out[i].append(t)
                if len(out[i]) < reqs[i]["output_len"]:
                    still.append(i)
                else:
                    self.ll.llama_memory_seq_rm(mem, seq_ids[i], -1, -1)
            active = still
        return out

    def run_batched(self) -> list[list[int]]:
        """All requests at once; sequence ids in `--seq-order` (see `seq_order`)."""
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx), True)
        order = seq_order(self.requests, self.args.seq_order)
        outs = self._generate(self.ctx, [self.requests[i] for i in order],
                              list(range(len(order))))
        by_request: list[list[int]] = [[] for _ in order]
        for i, out in zip(order, outs, strict=True):
            by_request[i] = out
        return by_request

    def run_batch1(self, reqs: list[dict]) -> list[list[int]]:
        """`reqs` one after another, each alone in `ctx1`."""
        outs = []
        for r in reqs:
            self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx1), True)
            outs += self._generate(self.ctx1, [r], [0])
        return outs

    def first_logprobs(self, prompt: list[int], token_ids: list[int]) -> tuple[int, list[float]]:
        """`prompt` alone in `ctx1`: the argmax after its last token and the log-softmax
        (float64) there at `token_ids`.

        Raises:
            ValueError: the prompt is longer than the batch-1 context or than n_batch.
        """
        if len(prompt) > min(self.seq_cells, self.args.n_batch):
            raise ValueError(f"prompt of {len(prompt)} tokens does not fit")
        self.ll.llama_memory_clear(self.ll.llama_get_memory(self.ctx1), True)
        last = np.zeros(len(prompt), np.int8)
        last[-1] = 1
        row = self.batch.decode_logits(self.ctx1, np.asarray(prompt, np.int32),
                                       np.arange(len(prompt)), np.zeros(len(prompt)), last,
                                       self.n_vocab)[0].astype(np.float64)
        top = row.max()
        logprobs = row - top - np.log(np.exp(row - top).sum())
        return int(row.argmax()), [float(logprobs[t]) for t in token_ids]

    def close(self) -> None:
        for ctx in (self.ctx, self.ctx1):
            self.ll.llama_free(ctx)
        self.ll.llama_model_free(self.model)


def seq_order(requests: list[dict], how: str) -> list[int]:
    """Request indices in the order they get sequence ids 0, 1, ...: `arrival`, or
    `longest-first` (decreasing output_len, ties in arrival order). With one KV stream per
    sequence llama.cpp cuts a batch into ubatches of consecutive sequence ids
    (`llama_batch_allocr::split_equal(sequential=true)`), so a request that finishes before a
    higher-numbered one leaves a gap that splits every later step; longest-first keeps the
    running set 0..k-1 and each step one ubatch.

    Raises:
        ValueError: unknown `how`.
    """
    if how == "arrival":
        return list(range(len(requests)))
    if how == "longest-first":
        return sorted(range(len(requests)), key=lambda i: -requests[i]["output_len"])
    raise ValueError(f"unknown sequence order {how!r}")


def _quiet_logs(ll: Any) -> Any:
    """Route llama.cpp's log to stderr, WARN (ggml level 3) and above only; returns the
    callback, which the caller keeps alive."""
    @ll.llama_log_callback
    def callback(level: int, text: bytes, user_data: Any) -> None:
        if level >= 3 or (level == 5 and callback.last >= 3):  # 5 = continuation
            sys.stderr.write(text.decode(errors="replace"))
        if level != 5:
            callback.last = level
    callback.last = 0
    ll.llama_log_set(callback, ctypes.c_void_p())
    return callback


def serve(args: argparse.Namespace, proto: TextIO) -> None:
    """Load the GGUF, announce readiness on `proto`, then answer the commands read on stdin.

    Raises:
        RuntimeError: llama.cpp failed, or a request produced a wrong number of tokens.
        ValueError: an unknown command or mode.
    """
    if args.lib_dir:
        os.environ["LLAMA_CPP_LIB_PATH"] = args.lib_dir
    import llama_cpp
    import llama_cpp.llama_cpp as ll

    keep = _quiet_logs(ll)  # noqa: F841  # the C side holds only a pointer to it
    with open(args.requests) as f:
        requests = json.load(f)
    t0 = time.perf_counter()
    ll.llama_backend_init()
    engine = Engine(ll, args, requests)
    load_s = time.perf_counter() - t0
    send(proto, {"event": "ready", "llama_cpp_python_version": llama_cpp.__version__,
                  "gguf": args.model, "load_s": round(load_s, 2), "num_requests": len(requests),
                  "config": engine.config(),
                  "system_info": ll.llama_print_system_info().decode().strip()})
    try:
        for cmd in run_commands(sys.stdin, ("run", "logprobs")):
            if cmd["cmd"] == "logprobs":
                got = [engine.first_logprobs(p, t)
                       for p, t in zip(cmd["prompts"], cmd["token_ids"], strict=True)]
                send(proto, {"event": "logprobs", "argmax": [a for a, _ in got],
                             "logprobs": [lp for _, lp in got]})
                continue
            mode = cmd.get("mode", "batched")
            if mode not in ("batched", "batch1"):
                raise ValueError(f"unknown mode {mode!r}")
            reqs = requests if mode == "batched" else requests[:cmd.get("num_requests", 8)]
            if mode == "batch1" and cmd.get("output_len"):
                reqs = [{**r, "output_len": int(cmd["output_len"])} for r in reqs]
            t0 = time.perf_counter()
            token_ids = (engine.run_batched() if mode == "batched"
                         else engine.run_batch1(reqs))
            seconds = time.perf_counter() - t0
            for ids, r in zip(token_ids, reqs, strict=True):
                if len(ids) != r["output_len"]:
                    raise RuntimeError(f"llama.cpp: {len(ids)} tokens, expected {r['output_len']}")
            reply: dict[str, Any] = {"event": "run", "mode": mode, "seconds": seconds,
                                     "output_tokens": sum(len(t) for t in token_ids)}
            if cmd.get("return_token_ids"):
                reply["token_ids"] = token_ids
            send(proto, reply)
    finally:
        engine.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="GGUF file")
    p.add_argument("--requests", required=True, help="JSON file of the workload's requests")
    p.add_argument("--lib-dir", default=None,
                   help="folder of libllama.so (default: $LLAMA_CPP_LIB_PATH, else the package's)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="n_threads (one-token batches; default: the CPUs this process may use)")
    p.add_argument("--threads-batch", type=int, default=None,
                   help="n_threads_batch (batches of > 1 token; default --threads)")
    p.add_argument("--n-batch", type=int, default=2048, help="tokens per llama_decode")
    p.add_argument("--n-ubatch", type=int, default=512, help="tokens per compute graph")
    p.add_argument("--flash-attn", choices=sorted(FLASH_ATTN), default="off",
                   help="off measured 20-30%% faster than on here (bench/NOTES.md section 13)")
    p.add_argument("--type-k", choices=sorted(KV_TYPES), default="f16")
    p.add_argument("--type-v", choices=sorted(KV_TYPES), default="f16")
    p.add_argument("--seq-order", choices=["longest-first", "arrival"], default="longest-first",
                   help="which requests get the low sequence ids in the batched mode")
    p.add_argument("--extra-bufts", choices=["on", "off"], default="on",
                   help="AMX / repacked weight layouts of ggml-cpu (llama_model_params."
                        "use_extra_bufts)")
    p.add_argument("--kv-unified", action="store_true",
                   help="one KV buffer for all sequences (default: one stream per sequence)")
    args = p.parse_args()
    return run_runner(serve, args)


if __name__ == "__main__":
    sys.exit(main())
