"""The offline `LLM` API as vLLM documents it: prompt shapes (one string is one prompt),
RequestOutput / CompletionOutput results, logprobs, stop reasons, chat templates, the progress
bar; a refused batch leaves the engine clean; only local checkpoints."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import moe_engine.offline.llm as llm_module
from moe_engine import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from moe_engine.errors import ParamError, RequestError, StartupError
from moe_engine.startup.demo import write_tokenizer

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tok_ckpt(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE with a 512-token byte-level BPE (the demo's tokenizer recipe, its
    chat template included) trained on 300 kB of standard-library source."""
    path = tmp_path_factory.mktemp("tok") / "qwen3-with-tokenizer"
    shutil.copytree(qwen3_ckpt, path)
    write_tokenizer(path, vocab_size=512, max_chars=300_000)
    return path


@pytest.fixture(scope="module")
def llm(tok_ckpt: Path) -> LLM:
    return LLM(model=str(tok_ckpt), max_model_len=256)


def test_refused_batch_runs_nothing_and_the_next_call_works(qwen3_ckpt) -> None:
    llm = LLM(model=str(qwen3_ckpt), max_model_len=128)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with pytest.raises(RequestError, match="prompt"):
        llm.generate([[5, 6, 7], []], params)  # the second prompt is empty
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5, 6, 7], [8, 9]], [params])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate([[5, 6, 7], "text"], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.plan.num_blocks
    outs = llm.generate([[5, 6, 7]], params)
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 3


def test_an_interrupted_run_leaves_no_request_behind(llm, monkeypatch) -> None:
    real_step, calls = llm.engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(llm.engine, "step", step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.plan.num_blocks


def test_one_string_or_one_id_list_is_one_prompt(llm) -> None:
    [one] = llm.generate("hello", GREEDY, use_tqdm=False)  # not five one-character prompts
    assert one.prompt == "hello"
    assert one.prompt_token_ids == llm.get_tokenizer().encode("hello")
    [ids] = llm.generate([5, 6, 7], GREEDY, use_tqdm=False)
    assert ids.prompt is None and ids.prompt_token_ids == [5, 6, 7]
    many = llm.generate(["hello", "import os"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in many] == ["hello", "import os"]
    assert many[0].outputs[0].token_ids == one.outputs[0].token_ids
    lists = llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in lists] == [[5, 6, 7], [8, 9]]
    assert lists[0].outputs[0].token_ids == ids.outputs[0].token_ids
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_text_and_token_prompt_dicts(llm) -> None:
    text, tokens, both = llm.generate(
        [{"prompt": "hello"}, {"prompt_token_ids": [5, 6, 7]},
         {"prompt": "shown", "prompt_token_ids": [5, 6, 7]}],
        GREEDY,
        use_tqdm=False,
    )
    assert text.prompt == "hello" and text.prompt_token_ids == llm.get_tokenizer().encode("hello")
    assert tokens.prompt is None and tokens.prompt_token_ids == [5, 6, 7]
    assert both.prompt == "shown" and both.outputs[0].token_ids == tokens.outputs[0].token_ids
    [single] = llm.generate({"prompt_token_ids": [5, 6, 7]}, GREEDY, use_tqdm=False)
    assert single.outputs[0].token_ids == tokens.outputs[0].token_ids


@pytest.mark.parametrize(
    "prompts", [[{"text": "x"}], [[5, "6"]], [3.5], [[True, 2]], 42, {"prompt": 5}]
)
def test_prompts_of_unknown_shape_are_refused(llm, prompts) -> None:
    with pytest.raises(ValueError, match="prompts"):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_results_have_vllms_shape(llm) -> None:
    outs = llm.generate(["def f(x):", [5, 6]], SamplingParams(max_tokens=4, ignore_eos=True,
                                                             temperature=0), use_tqdm=False)
    assert [o.request_id for o in outs] == [str(int(outs[0].request_id) + i) for i in range(2)]
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished and out.prompt_logprobs is None
        [c] = out.outputs
        assert isinstance(c, CompletionOutput) and c.index == 0 and c.finished()
        assert type(c.finish_reason) is str and c.finish_reason == "length"
        assert c.stop_reason is None and c.logprobs is None and c.cumulative_logprob is None
        assert len(c.token_ids) == 4
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_dicts_of_logprob_per_token(llm, temperature) -> None:
    params = SamplingParams(max_tokens=5, temperature=temperature, seed=3, logprobs=3,
                            ignore_eos=True)
    [out] = llm.generate("import", params, use_tqdm=False)
    c = out.outputs[0]
    tok = llm.get_tokenizer()
    assert len(c.logprobs) == len(c.token_ids) == 5
    for token_id, entry in zip(c.token_ids, c.logprobs, strict=True):
        assert next(iter(entry)) == token_id  # the sampled token first, as vLLM
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        top = sorted((lp for lp in entry.values() if lp.rank is not None), key=lambda x: x.rank)
        assert [lp.rank for lp in top] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:], strict=False))
        assert len(entry) in (3, 4)
        assert entry[token_id].decoded_token == tok.decode([token_id])
        if temperature == 0:
            assert entry[token_id].rank == 1 and len(entry) == 3
    total = sum(entry[t].logprob for t, entry in zip(c.token_ids, c.logprobs, strict=True))
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-6)


def _greedy_text_ending_in_last_token(llm, max_tokens: int) -> tuple[str, str, list[int]]:
    """A prompt and a stop string that only the last of `max_tokens` greedy tokens completes."""
    tok = llm.get_tokenizer()
    for prompt in ["def main():", "import os", "class A:", "for i in", "return x", "print("]:
        ids = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                  ignore_eos=True), use_tqdm=False)
        ids = ids[0].outputs[0].token_ids
        full = tok.decode(ids, skip_special_tokens=True)
        before = tok.decode(ids[:-1], skip_special_tokens=True)
        for width in (2, 3, 1):
            stop = full[-width:]
            if len(full) > width and stop.strip() and stop not in before and "\ufffd" not in full:
                return prompt, stop, ids
    raise AssertionError("no greedy continuation fits the test")


def test_stop_string_completed_by_the_last_allowed_token_is_stop(llm) -> None:
    prompt, stop, ids = _greedy_text_ending_in_last_token(llm, max_tokens=8)
    full = llm.get_tokenizer().decode(ids, skip_special_tokens=True)
    for max_tokens in (8, 12):  # at the length limit, and well before it: the same answer
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=stop)
        [c] = llm.generate(prompt, params, use_tqdm=False)[0].outputs
        assert (c.finish_reason, c.stop_reason) == ("stop", stop), max_tokens
        assert c.token_ids == ids and c.text == full[: full.index(stop)]


def test_stop_token_id_is_the_stop_reason_and_stays_in_the_ids(llm) -> None:
    [base] = llm.generate([5, 6, 7], SamplingParams(max_tokens=8, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)
    ids = base.outputs[0].token_ids
    stop_id = ids[2]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=stop_id)
    [c] = llm.generate([5, 6, 7], params, use_tqdm=False)[0].outputs
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.token_ids == ids[: ids.index(stop_id) + 1]


def test_a_refused_seed_leaves_the_llm_serving(llm) -> None:
    with pytest.raises(ParamError, match="seed"):
        SamplingParams(seed=2**64)
    params = SamplingParams(seed=1, max_tokens=3)
    params.seed = 2**64  # set after construction: the engine refuses it before it runs
    with pytest.raises(RequestError) as info:
        llm.generate([[5, 6, 7], [8, 9]], [GREEDY, params], use_tqdm=False)
    assert "seed" in info.value.message and not llm.engine.has_unfinished_requests()
    seeded = SamplingParams(seed=2**64 - 1, max_tokens=3, ignore_eos=True)
    a, b = (llm.generate([5, 6, 7], seeded, use_tqdm=False)[0].outputs[0] for _ in range(2))
    assert a.token_ids == b.token_ids and len(a.token_ids) == 3


def test_progress_bar_goes_to_stderr_and_use_tqdm_false_is_silent(llm, capsys) -> None:
    llm.generate(["a", "b", "c"], GREEDY)  # use_tqdm defaults to True, as in vLLM
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "3/3" in err and "output:" in err and "toks/s" in err
    llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_chat_applies_the_tokenizers_template(llm) -> None:
    tok = llm.get_tokenizer()
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi there"}]
    rendered = tok.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert rendered == "<|bos|>system\nBe brief.<|eos|>\n<|bos|>user\nHi there<|eos|>\n" \
                       "<|bos|>assistant\n"
    [out] = llm.chat(conversation, GREEDY, use_tqdm=False)
    assert out.prompt == rendered
    assert out.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert out.prompt_token_ids[0] == tok.bos_token_id
    [same] = llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)
    assert same.outputs[0].token_ids == out.outputs[0].token_ids
    other = [{"role": "user", "content": "import os"}]
    both = llm.chat([conversation, other], GREEDY, use_tqdm=False)
    assert [o.prompt for o in both] == [rendered, tok.apply_chat_template(
        other, add_generation_prompt=True, tokenize=False)]
    custom = llm.chat(other, GREEDY, use_tqdm=False,
                      chat_template="{{ messages[0]['content'] }}!")
    assert custom[0].prompt == "import os!"
    for bad in ("hi", [["hi"]], [{"role": "user", "content": "a"}, ["b"]]):
        with pytest.raises(ValueError, match="messages"):
            llm.chat(bad, use_tqdm=False)


def test_chat_without_a_template_says_so(tok_ckpt, tmp_path) -> None:
    path = tmp_path / "no-template"
    shutil.copytree(tok_ckpt, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    llm = LLM(model=str(path), max_model_len=64)
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("model", ["no-such-model", "/no/such/dir"])
def test_a_missing_checkpoint_is_refused_without_the_network(model: str) -> None:
    with pytest.raises(StartupError, match=f"model: '{model}' does not exist"):
        LLM(model=model)


def test_a_directory_without_config_json_is_refused(tmp_path) -> None:
    with pytest.raises(StartupError, match="no config.json"):
        LLM(model=str(tmp_path))


def test_kv_cache_memory_takes_the_servers_byte_counts(qwen3_ckpt):
    """`kv_cache_memory` as `moe-serve --kv-cache-memory` takes it: an int or text with a unit;
    anything else is refused naming the field."""
    llm = LLM(model=str(qwen3_ckpt), max_model_len=64, kv_cache_memory="2MiB")
    assert llm.engine.config.cache.kv_cache_memory == 2 * 1024**2
    with pytest.raises(ValueError, match="kv_cache_memory: expected bytes like"):
        LLM(model=str(qwen3_ckpt), max_model_len=64, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="kv_cache_memory must be a byte count"):
        LLM(model=str(qwen3_ckpt), max_model_len=64, kv_cache_memory=2.5)


@pytest.mark.parametrize(("order", "env", "late"), [
    ("import torch, moe_engine", {}, True),
    ("import moe_engine, torch", {}, False),
    ("import torch, moe_engine", {"OMP_WAIT_POLICY": "ACTIVE"}, False),
])
def test_torch_loaded_first_without_a_wait_policy_is_detected(order, env, late) -> None:
    """The PASSIVE policy `import moe_engine` sets reaches only a torch loaded after it."""
    base = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", f"{order}; "
                          "print(moe_engine.TORCH_LOADED_WITHOUT_WAIT_POLICY)"],
                         env={**base, **env}, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(late)


def test_llm_warns_when_torch_came_first_without_a_wait_policy(qwen3_ckpt, monkeypatch,
                                                               caplog) -> None:
    monkeypatch.setattr(llm_module, "TORCH_LOADED_WITHOUT_WAIT_POLICY", True)
    with caplog.at_level("WARNING", logger="moe_engine.offline.llm"):
        LLM(model=str(qwen3_ckpt), max_model_len=64)
    assert llm_module.WAIT_POLICY_WARNING in [r.getMessage() for r in caplog.records]
    monkeypatch.setattr(llm_module, "TORCH_LOADED_WITHOUT_WAIT_POLICY", False)
    caplog.clear()
    with caplog.at_level("WARNING", logger="moe_engine.offline.llm"):
        LLM(model=str(qwen3_ckpt), max_model_len=64)
    assert llm_module.WAIT_POLICY_WARNING not in [r.getMessage() for r in caplog.records]
