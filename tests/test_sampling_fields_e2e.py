"""The sampling fields of issue 44 end to end: repetition/frequency/presence penalties, min_p,
logit_bias, truncate_prompt_tokens and priority through HTTP (the `openai` client), gRPC and the
offline `LLM`, greedy outputs against `transformers.generate` on the same tiny checkpoint (its
`repetition_penalty`, and OpenAI's frequency/presence penalties as a logits processor written
out here), and bad values refused naming the field on each front end. One server per module
(`--scheduling-policy priority`); the LLM engine runs the default fcfs policy."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import openai
import pytest
import torch
from fixtures import _load_hf
from grpc_helpers import ServerThread, request
from http_helpers import API_KEY, MAX_MODEL_LEN, MODEL, NUM_BLOCKS, Grpc, tokenizer_checkpoint
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import SequenceBiasLogitsProcessor

from moe_engine import LLM, SamplingParams
from moe_engine.cli.serve import build_parser, engine_config_from_args
from moe_engine.errors import ParamError, RequestError
from moe_engine.server.app import ServerOptions
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

#: Ends with the tiny model's own greedy continuation, after which it repeats one token.
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 9, 160, 328, 345, 4, 172, 252, 118, 136]
NEW = 12
AUTH = {"Authorization": f"Bearer {API_KEY}"}


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency/presence penalties over the generated tokens (transformers has none):
    logit -= frequency * count + presence * (count > 0)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        out = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


def hf_generate(ckpt: Path, prompt: list[int], **kw) -> list[int]:
    """Greedy tokens from transformers' generate (EOS never stops it)."""
    model = _load_hf(str(ckpt))
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             do_sample=False, eos_token_id=model.config.vocab_size + 1,
                             pad_token_id=model.config.pad_token_id, **kw)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def ckpt(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("sampling"))


@pytest.fixture(scope="module")
def server(ckpt: Path) -> Iterator[ServerThread]:
    config = EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=MAX_MODEL_LEN, seed=1234),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512,
                                  policy="priority"),
    )
    opts = ServerOptions(port=0, http_port=0, api_key=API_KEY, served_model_name=MODEL,
                         log_stats_interval_s=None)
    handle = ServerThread(config, opts)
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


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> LLM:
    return LLM(model=str(ckpt), max_model_len=MAX_MODEL_LEN, num_blocks_override=32)


def completion_ids(client: openai.OpenAI, prompt: list[int], **extra) -> tuple[list[int], int]:
    """(greedy token ids, usage.prompt_tokens) of one /v1/completions call."""
    body = {"return_token_ids": True, **extra}
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW, temperature=0,
                                  extra_body=body)  # fmt: skip
    return r.choices[0].token_ids, r.usage.prompt_tokens


def grpc_ids(rpc: Grpc, prompt: list[int], **fields) -> list[int]:
    fields.setdefault("ignore_eos", True)
    out = rpc.generate(request(prompt, max_tokens=NEW, temperature=0, **fields))
    return [t for r in out for t in r.token_ids]


def test_repetition_penalty_matches_transformers_through_llm_http_and_grpc(ckpt, llm, client,
                                                                          rpc):  # fmt: skip
    plain = hf_generate(ckpt, PROMPT)
    want = hf_generate(ckpt, PROMPT, repetition_penalty=1.8)
    assert want != plain, "the penalty must change this output for the test to mean anything"
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, repetition_penalty=1.8)
    assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == want
    assert completion_ids(client, PROMPT, repetition_penalty=1.8, ignore_eos=True)[0] == want
    assert grpc_ids(rpc, PROMPT, repetition_penalty=1.8) == want


def test_frequency_and_presence_penalties_match_the_openai_formula(ckpt, llm, client, rpc):
    for freq, pres in ((2.0, 0.0), (0.5, 1.5)):
        proc = LogitsProcessorList([OpenAIPenalties(len(PROMPT), freq, pres)])
        want = hf_generate(ckpt, PROMPT, logits_processor=proc)
        assert want != hf_generate(ckpt, PROMPT)
        params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True,
                                frequency_penalty=freq, presence_penalty=pres)
        assert llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == want
        got = completion_ids(client, PROMPT, frequency_penalty=freq, presence_penalty=pres,
                             ignore_eos=True)[0]  # fmt: skip
        assert got == want
        assert grpc_ids(rpc, PROMPT, frequency_penalty=freq, presence_penalty=pres) == want


def test_logit_bias_string_keys_on_http_and_map_on_grpc(client, rpc):
    ids, _ = completion_ids(client, PROMPT, logit_bias={"42": 100})
    assert ids == [42] * NEW
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
        logit_bias={"77": 100}, extra_body={"return_token_ids": True},
    )
    assert chat.choices[0].token_ids == [77] * 4
    assert grpc_ids(rpc, PROMPT, logit_bias={9: 100.0}) == [9] * NEW


def test_min_p_one_keeps_only_the_most_likely_token(client, rpc):
    greedy, _ = completion_ids(client, PROMPT, ignore_eos=True)
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=1.0,
                                  extra_body={"min_p": 1.0, "return_token_ids": True,
                                              "ignore_eos": True})  # fmt: skip
    assert r.choices[0].token_ids == greedy
    out = rpc.generate(request(PROMPT, max_tokens=NEW, temperature=1.0, min_p=1.0,
                               ignore_eos=True))  # fmt: skip
    assert [t for x in out for t in x.token_ids] == greedy


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm, client, rpc):
    long = list(range(20, 60)) + PROMPT[-4:]
    want, n = completion_ids(client, PROMPT[-4:])
    got, m = completion_ids(client, long, truncate_prompt_tokens=4)
    assert (got, m, n) == (want, 4, 4)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a long question " * 20}], max_tokens=2,
        extra_body={"truncate_prompt_tokens": 5},
    )
    assert chat.usage.prompt_tokens == 5
    assert grpc_ids(rpc, long, truncate_prompt_tokens=4, ignore_eos=False) == want
    params = SamplingParams(max_tokens=NEW, temperature=0, truncate_prompt_tokens=4)
    out = llm.generate([long], params, use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT[-4:] and out.outputs[0].token_ids == want


def test_priority_is_accepted_under_the_priority_policy_and_refused_under_fcfs(client, rpc,
                                                                               llm):  # fmt: skip
    ids, _ = completion_ids(client, PROMPT, priority=-3)
    assert ids == completion_ids(client, PROMPT)[0]
    assert grpc_ids(rpc, PROMPT, priority=5)
    with pytest.raises(RequestError, match="--scheduling-policy") as info:
        llm.generate([PROMPT], SamplingParams(max_tokens=2), priority=[1], use_tqdm=False)
    assert info.value.field == "priority"
    assert llm.generate([PROMPT], SamplingParams(max_tokens=2), priority=[0], use_tqdm=False)


HTTP_BAD = [
    ({"repetition_penalty": 0}, "repetition_penalty", "> 0"),
    ({"frequency_penalty": 3}, "frequency_penalty", "[-2, 2]"),
    ({"presence_penalty": -2.5}, "presence_penalty", "[-2, 2]"),
    ({"min_p": 1.5}, "min_p", "[0, 1]"),
    ({"logit_bias": {"5": -101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"five": 1}}, "logit_bias", "not a token id"),
    ({"logit_bias": {"100000": 1}}, "logit_bias", "outside [0, "),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1 or -1"),
    ({"truncate_prompt_tokens": 4096}, "truncate_prompt_tokens", "max_model_len"),
]


@pytest.mark.parametrize(("extra", "field", "text"), HTTP_BAD, ids=[b[1] + str(i)
                                                                   for i, b in enumerate(HTTP_BAD)])
def test_bad_values_are_refused_naming_the_field_on_http_and_grpc(server, rpc, extra, field,
                                                                  text):  # fmt: skip
    url = f"http://127.0.0.1:{server.server.http_port}"
    for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "max_tokens": 2})):  # fmt: skip
        resp = httpx.post(url + path, json={**body, **extra}, headers=AUTH, timeout=30)
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == field and text in error["message"], error
    fields = {k: ({int(t): b for t, b in v.items()} if k == "logit_bias" else v)
              for k, v in extra.items() if k != "logit_bias" or "five" not in v}
    if not fields:
        return  # a non-integer key cannot be put in the proto's map
    with pytest.raises(grpc.RpcError) as info:
        rpc.generate(request(PROMPT, max_tokens=2, **fields))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in info.value.details() and text in info.value.details()


def test_bad_values_are_refused_by_the_llm(llm):
    with pytest.raises(ParamError, match="min_p must be in"):
        SamplingParams(min_p=2)
    with pytest.raises(RequestError, match="logit_bias token id 999999") as info:
        llm.generate([PROMPT], SamplingParams(logit_bias={999999: 1.0}), use_tqdm=False)
    assert info.value.field == "logit_bias"


def test_engine_seed_makes_unseeded_sampling_reproducible(ckpt):
    args = build_parser().parse_args(["--seed", "7", "--scheduling-policy", "priority"])
    config = engine_config_from_args(args, str(ckpt))
    assert (config.model.seed, config.scheduler.policy) == (7, "priority")
    params = SamplingParams(max_tokens=NEW, temperature=1.0, ignore_eos=True)
    tokens = []
    for seed in (7, 7, 8):  # a fresh engine each: a restart
        engine = LLM(model=str(ckpt), max_model_len=MAX_MODEL_LEN, num_blocks_override=32,
                     seed=seed)  # fmt: skip
        outs = engine.generate([PROMPT] * 3, params, use_tqdm=False)
        tokens.append([o.outputs[0].token_ids for o in outs])
    assert tokens[0] == tokens[1] and tokens[0] != tokens[2]


def test_with_ngram_speculation_processor_requests_take_no_drafts_and_match(ckpt):
    """Speculation on: requests with a penalty or logit_bias get transformers' tokens (they
    take no drafts: the verification knows no processors, and their repeats would give n-gram
    drafts); a plain request of the same batch still drafts."""
    freq = LogitsProcessorList([OpenAIPenalties(len(PROMPT), -2.0, 0.0)])
    bias = LogitsProcessorList([SequenceBiasLogitsProcessor([[[136], 30.0]])])
    wants = [hf_generate(ckpt, PROMPT, logits_processor=freq),
             hf_generate(ckpt, PROMPT, logits_processor=bias), hf_generate(ckpt, PROMPT)]
    spec = LLM(model=str(ckpt), max_model_len=MAX_MODEL_LEN, num_blocks_override=32,
               speculative_method="ngram", num_speculative_tokens=3)  # fmt: skip
    params = [SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, **kw)
              for kw in ({"frequency_penalty": -2.0}, {"logit_bias": {136: 30.0}}, {})]
    outs = spec.generate([PROMPT] * 3, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == wants
    assert spec.engine.drafter.stats.num_drafts > 0  # the plain one drafted
