"""The offline `LLM` API: a refused batch leaves the engine clean; only local checkpoints."""

from __future__ import annotations

import pytest

from moe_engine import LLM, SamplingParams
from moe_engine.errors import RequestError, StartupError


def test_refused_batch_runs_nothing_and_the_next_call_works(qwen3_ckpt) -> None:
    llm = LLM(model=str(qwen3_ckpt), max_model_len=128)
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    with pytest.raises(RequestError, match="prompt"):
        llm.generate([[5, 6, 7], []], params)  # the second prompt is empty
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate([[5, 6, 7], [8, 9]], [params])
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.plan.num_blocks
    outs = llm.generate([[5, 6, 7]], params)
    assert len(outs) == 1 and len(outs[0].token_ids) == 3


@pytest.mark.parametrize("model", ["no-such-model", "/no/such/dir"])
def test_a_missing_checkpoint_is_refused_without_the_network(model: str) -> None:
    with pytest.raises(StartupError, match="no config.json"):
        LLM(model=model)
