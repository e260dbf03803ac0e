"""Byte-exact text on every front end (issue 44, item 5), with a byte-level BPE whose tokens
split UTF-8 characters (`bpe_tokenizer`) on the tiny Qwen3-MoE:

- a stop string completed by a token that also starts a multi-byte character ends the request
  at that token with finish_reason "stop" and the stop string cut (kept with
  include_stop_str_in_output), also when that token is the last max_tokens allows: `LLM`, HTTP
  completions whole and streamed, gRPC;
- chat logprobs' `bytes` are each token's own bytes and rebuild the text, whole and streamed;
- legacy completions' `logprobs.tokens` concatenate to the text and `text_offset` points at
  each token's text, whole and streamed;
- skip_special_tokens false keeps special tokens' text, on every front end.

The greedy outputs of the random model are found first (with `LLM`), then asked for again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from bpe_tokenizer import bpe_checkpoint, token_bytes_table
from grpc_helpers import ServerThread, request
from http_helpers import API_KEY, MODEL, Grpc, start_server, wait_idle

from moe_engine import LLM, SamplingParams

#: Prompts (token ids) whose greedy continuations are searched for a case.
PROMPTS = [[i, 40 + i] for i in range(16, 48)]
SEARCH_TOKENS = 24
GREEDY = {"temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def ckpt(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return bpe_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(model=str(ckpt), max_model_len=128)


@pytest.fixture(scope="module")
def greedy(llm: LLM) -> list[list[int]]:
    """The greedy continuation of each of PROMPTS."""
    params = SamplingParams(max_tokens=SEARCH_TOKENS, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[ServerThread]:
    handle = start_server(ckpt)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Iterator[openai.OpenAI]:
    url = f"http://127.0.0.1:{server.server.http_port}/v1"
    with openai.OpenAI(base_url=url, api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def rpc(server: ServerThread) -> Iterator[Grpc]:
    handle = Grpc(server.address)
    yield handle
    handle.close()


def _lead_bytes(b: bytes) -> int:
    """How many bytes at the end of `b` start a multi-byte character they do not finish."""
    for k in range(1, min(3, len(b)) + 1):
        lead, rest = b[-k], b[len(b) - k + 1:]
        need = 2 if 0xC2 <= lead < 0xE0 else 3 if 0xE0 <= lead < 0xF0 else 4 if lead >= 0xF0 else 0
        if need > k and lead < 0xF5 and all(0x80 <= x < 0xC0 for x in rest):
            return k
        if not 0x80 <= lead < 0xC0:
            return 0
    return 0


@pytest.fixture(scope="module")
def stop_case(llm: LLM, greedy) -> tuple[list[int], list[int], str, str]:
    """(prompt, greedy ids up to and including token k, stop string, text before the stop):
    token k ends in ASCII then the first byte(s) of a multi-byte character, and the stop
    string ends with that ASCII text (its first occurrence)."""
    tok = llm.get_tokenizer()
    table = token_bytes_table(tok)
    for prompt, ids in zip(PROMPTS, greedy, strict=True):
        for k in range(1, len(ids)):
            b = table[ids[k]]
            lead = _lead_bytes(b)
            head = b[: len(b) - lead]
            if not lead or not head or not head.isascii() or ids[k] < 16:
                continue
            text = tok.decode(ids[: k + 1], skip_special_tokens=True)
            assert text.endswith("\ufffd")
            done = text[:-1]  # the whole characters so far
            for width in range(1, 6):
                stop = done[-width:]
                if "\ufffd" not in stop and stop.strip() and done.find(stop) == len(done) - width:
                    return prompt, ids[: k + 1], stop, done[:-width]
    raise AssertionError("no greedy continuation has a token that starts a character")


def test_llm_stop_string_completed_by_a_token_that_starts_a_character(llm, stop_case) -> None:
    prompt, ids, stop, before = stop_case
    for max_tokens in (len(ids), len(ids) + 4):  # the last allowed token, and mid-stream
        params = SamplingParams(max_tokens=max_tokens, stop=stop, **GREEDY)
        [c] = llm.generate([prompt], params, use_tqdm=False)[0].outputs
        assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, before), max_tokens
        assert c.token_ids == ids
    params = SamplingParams(max_tokens=len(ids), stop=stop, include_stop_str_in_output=True,
                            **GREEDY)
    [c] = llm.generate([prompt], params, use_tqdm=False)[0].outputs
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, before + stop)


def test_http_stop_string_completed_by_a_token_that_starts_a_character(client, stop_case
                                                                       ) -> None:
    prompt, ids, stop, before = stop_case
    for include in (False, True):
        for max_tokens in (len(ids), len(ids) + 4):
            fields = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stop": stop,
                      "temperature": 0, "extra_body": {
                          "ignore_eos": True, "include_stop_str_in_output": include}}
            whole = client.completions.create(**fields).choices[0]
            chunks = list(client.completions.create(stream=True, **fields))
            streamed = "".join(ch.choices[0].text for ch in chunks if ch.choices)
            want = before + stop * include
            assert (whole.finish_reason, whole.text, streamed) == ("stop", want, want)
            assert whole.model_extra["stop_reason"] == stop
            assert chunks[-1].choices[0].finish_reason == "stop"


def test_grpc_stop_string_completed_by_a_token_that_starts_a_character(rpc, stop_case) -> None:
    prompt, ids, stop, before = stop_case
    for include in (False, True):
        for max_tokens in (len(ids), len(ids) + 4):
            extra = {"include_stop_str_in_output": True} if include else {}
            out = rpc.generate(request(prompt, max_tokens=max_tokens, stop=[stop], **extra,
                                       **GREEDY))
            assert [t for r in out for t in r.token_ids] == ids
            assert "".join(r.text for r in out) == before + stop * include
            assert (out[-1].finish_reason, out[-1].stop_string) == ("stop", stop)


def _check_bytes(entries: list, text: str, table: dict[int, bytes], skip: bool) -> None:
    """The `bytes` of the tokens (special ones left out when `skip`ped from the text) rebuild
    `text`; each is the vocabulary's, top ones too."""
    special = {b for b in table.values() if b.startswith(b"<|")}
    kept = [e for e in entries if not (skip and bytes(e["bytes"]) in special)]
    rebuilt = b"".join(bytes(e["bytes"]) for e in kept)
    assert rebuilt.decode("utf-8", errors="replace") == text
    assert any(_lead_bytes(bytes(e["bytes"])) for e in entries), "no split character: weak test"
    vocab = set(table.values())
    for e in entries:
        assert bytes(e["bytes"]) in vocab
        assert all(bytes(t["bytes"]) in vocab for t in e["top_logprobs"])


@pytest.mark.parametrize("skip", [True, False])
def test_chat_logprob_bytes_rebuild_the_text(server, llm, skip) -> None:
    table = token_bytes_table(llm.get_tokenizer())
    url = f"http://127.0.0.1:{server.server.http_port}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    body = {"messages": [{"role": "user", "content": "日本語 café 😀"}], "max_tokens": 40,
            "logprobs": True, "top_logprobs": 2, **GREEDY}
    if not skip:
        body["skip_special_tokens"] = False
    whole = httpx.post(url, json=body, headers=auth, timeout=60).json()["choices"][0]
    text = whole["message"]["content"]
    _check_bytes(whole["logprobs"]["content"], text, table, skip)
    streamed, entries = "", []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=auth,
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for ch in json.loads(line[6:])["choices"]:
                    streamed += ch["delta"].get("content") or ""
                    entries += (ch["logprobs"] or {}).get("content") or []
    assert streamed == text
    _check_bytes(entries, text, table, skip)


def test_legacy_tokens_and_text_offset_follow_the_text(client, greedy) -> None:
    fields = {"model": MODEL, "prompt": PROMPTS[:6], "max_tokens": SEARCH_TOKENS, "logprobs": 1,
              "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**fields)
    assert [c.model_extra.get("token_ids") for c in whole.choices] == [None] * 6
    chunks = list(client.completions.create(stream=True, **fields))
    for c in sorted(whole.choices, key=lambda c: c.index):
        streamed = [s for ch in chunks for s in ch.choices if s.index == c.index]
        text = "".join(s.text for s in streamed)
        assert text == c.text
        offsets = [o for s in streamed for o in s.logprobs.text_offset]
        tokens = [t for s in streamed for t in s.logprobs.tokens]
        assert (tokens, offsets) == (c.logprobs.tokens, c.logprobs.text_offset)
        assert len(tokens) == SEARCH_TOKENS and "".join(tokens) == text
        for token, offset in zip(tokens, offsets, strict=True):
            assert text[offset: offset + len(token)] == token


def test_skip_special_tokens_false_keeps_their_text(llm, client, rpc, greedy) -> None:
    tok = llm.get_tokenizer()
    found = [(p, ids) for p, ids in zip(PROMPTS, greedy, strict=True) if min(ids) < 16]
    assert found, "no greedy continuation holds a special token"
    prompt, ids = found[0]
    for skip in (True, False):
        want = tok.decode(ids, skip_special_tokens=skip)
        params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip, **GREEDY)
        assert llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text == want
        resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=len(ids),
                                         temperature=0, extra_body={
                                             "ignore_eos": True, "skip_special_tokens": skip})
        assert resp.choices[0].text == want
        out = rpc.generate(request(prompt, max_tokens=len(ids), skip_special_tokens=skip,
                                   **GREEDY))
        assert "".join(r.text for r in out) == want
    assert "<|" in tok.decode(ids, skip_special_tokens=False)
    wait_idle(rpc)


def test_stop_token_text_is_left_out_unless_asked_for(llm, rpc, greedy) -> None:
    """As vLLM: the token (stop_token_ids entry or EOS) that ended a request adds no text,
    unless include_stop_str_in_output."""
    tok = llm.get_tokenizer()
    prompt, ids = next((p, ids) for p, ids in zip(PROMPTS, greedy, strict=True)
                       if tok.decode(ids[3:4]).strip() and ids.index(ids[3]) == 3)
    for include in (False, True):
        want = tok.decode(ids[: 4 if include else 3], skip_special_tokens=True)
        extra = {"include_stop_str_in_output": True} if include else {}
        params = SamplingParams(max_tokens=SEARCH_TOKENS, stop_token_ids=[ids[3]], **extra,
                                **GREEDY)
        [c] = llm.generate([prompt], params, use_tqdm=False)[0].outputs
        assert (c.token_ids, c.text, c.stop_reason) == (ids[:4], want, ids[3])
        out = rpc.generate(request(prompt, max_tokens=SEARCH_TOKENS, stop_token_ids=[ids[3]],
                                   **extra, **GREEDY))
        assert "".join(r.text for r in out) == want and out[-1].stop_token_id == ids[3]
