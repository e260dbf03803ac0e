"""Sampler and detokenizer: greedy, top-k/top-p, seeds, logprobs, stop strings held back."""

from __future__ import annotations

import torch

from moe_engine.core.detokenizer import IncrementalDetokenizer
from moe_engine.request import Request
from moe_engine.runner.sampler import Sampler, apply_top_k_top_p
from moe_engine.sampling_params import SamplingParams


def req(rid, **kw):
    return Request(rid, [1, 2], SamplingParams(**kw))


def test_greedy_is_argmax_and_logprobs_are_log_softmax():
    logits = torch.randn(3, 50)
    out = Sampler()(logits, [req(str(i), temperature=0, logprobs=3) for i in range(3)])
    assert out.token_ids == logits.argmax(-1).tolist()
    logp = logits.log_softmax(-1)
    for i, (chosen, top) in enumerate(out.logprobs):
        assert abs(chosen - float(logp[i].max())) < 1e-6
        assert list(top) == logp[i].topk(3).indices.tolist()


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 100)
    s = Sampler(seed=5)
    a = s(logits, [req(str(i), temperature=1.0, top_k=1) for i in range(4)])
    b = s(logits, [req(str(i), temperature=1.0, top_p=1e-6) for i in range(4)])
    assert a.token_ids == b.token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_mask():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    masked = apply_top_k_top_p(logits, torch.tensor([3]), torch.tensor([0.7]))
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]


def test_same_seed_same_tokens_and_distribution_is_followed():
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    s = Sampler()
    a = s(logits[:8], [req(str(i), temperature=1.0, seed=42) for i in range(8)]).token_ids
    b = Sampler()(logits[:8], [req(str(i), temperature=1.0, seed=42) for i in range(8)]).token_ids
    assert a == b
    ids = torch.tensor(s(logits, [req(f"r{i}", temperature=1.0) for i in range(4000)]).token_ids)
    freq = torch.bincount(ids, minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.04)


class CharTokenizer:
    """One character per token id: id i decodes to chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def feed(detok, text, final_check=True):
    deltas, stopped = [], False
    for ch in text:
        stopped = detok.add(ord(ch))
        deltas.append(detok.take_delta(final=stopped))
        if stopped:
            break
    return deltas, stopped


def test_stop_string_is_never_streamed_and_cut():
    detok = IncrementalDetokenizer(CharTokenizer(), ["END"])
    deltas, stopped = feed(detok, "abcENxyzEND!!")
    assert stopped and "".join(deltas) == "abcENxyz"
    assert all("END" not in d for d in deltas)
    # "E" and "EN" were held back until "x" proved they were not the stop string
    assert deltas[3] == "" and deltas[4] == ""


def test_no_stop_streams_everything():
    detok = IncrementalDetokenizer(CharTokenizer(), [])
    deltas, stopped = feed(detok, "hello")
    assert not stopped and deltas == list("hello")


def test_tiny_temperature_is_greedy_not_overflow():
    logits = torch.randn(3, 40) * 5
    out = Sampler()(logits, [req(str(i), temperature=t) for i, t in enumerate([1e-38, 1e-6, 0.0])])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_final_delta_flushes_an_incomplete_utf8_tail():
    class ByteTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    detok = IncrementalDetokenizer(ByteTokenizer(), [])
    text = ""
    for b in "ok \u00e9".encode()[:-1]:  # ends inside the two-byte sequence of "é"
        detok.add(b)
        text += detok.take_delta(final=False)
    text += detok.take_delta(final=True)
    assert text == bytes("ok \u00e9".encode()[:-1]).decode("utf-8", errors="replace")


def test_max_model_len_must_be_at_least_two():
    import pytest

    from moe_engine.startup.config import ModelConfig

    for bad in (0, 1, -5):
        with pytest.raises(ValueError, match="max_model_len must be >= 2"):
            ModelConfig(model="x", max_model_len=bad)
