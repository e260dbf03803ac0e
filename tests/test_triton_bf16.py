"""bfloat16 checkpoints end to end through the Triton kernels (fused MoE, paged attention,
MLA decode) under Triton's interpreter, against the torch backend on the same weights.

The Triton e2e tests elsewhere (tests/test_triton_serving.py) serve float32 checkpoints, whose
dots take the kernels' fp32 path; a served model is bf16, which takes the 16-bit path: bf16
operands, the P @ V operand cast, the bf16 output rounding and the split merge's rounding. Under
the interpreter those paths have two gaps, which the kernels close themselves
(`kernels.moe.fused_moe._interpret_bf16`, `triton_attention._dot_flags`): `tl.dot` multiplies
the raw bf16 bit patterns (so dot operands are upcast to fp32, exactly) and the fp32 -> bf16
cast truncates (so the kernels round to nearest even before it, as compiled Triton does). A
kernel that missed either would give logits far outside the tolerance below.

Method. Both backends compute in bf16 on the same bf16 weights (MOE_ENGINE_FORCE_BF16=1, so
on any CPU) but round at different points (the kernels accumulate whole dots in fp32 and round
once; torch rounds each op's output). A float32 run of the same weights (upcast exactly) is the
reference; its greedy path is forced on both bf16 runs (teacher forcing through the logits the
sampler sees), so every step's logits are comparable even after a near tie, and a greedy pick
of a bf16 run is its own argmax on that path.

Tolerances, per step (two prompts, 4 new tokens: 5 steps, 9 logits rows a model):
- the Triton backend's relative error (Frobenius, over the step's logits) against float32 is
  within twice the torch backend's own plus bf16's machine epsilon 2**-8: the Triton path is no
  noisier than torch's (measured: 0.5-1.2% for both, the Triton one the smaller in 7 of 15
  steps);
- both under 3% and every |logit - float32 logit| under 0.06 (1.5x the largest measured,
  0.039; the logits' std is about 0.8): bf16 noise, while a kernel that missed an interpreter
  gap is far off (an attention dot on raw bf16 bits gave 150% at the first step);
- greedy picks equal (Triton, torch and float32) wherever the float32 top-2 margin exceeds
  2 x 0.06, which no deviation within the bound can flip; at least 3 such picks per model
  (the tiny random models have real near ties: margins from 0.000 to 0.9).
The tiny checkpoints use weights of std 0.1: with the fixtures' default 0.5, bf16 noise flips
routing decisions and the float32 gap is chaotic (measured 5-110% for torch's bf16 path).
"""

from __future__ import annotations

import pytest
import torch
from fixtures import make_tiny_checkpoint

from moe_engine import LLM, SamplingParams

pytest.importorskip("triton")

PROMPT_LENS = (3, 21)  # a one-block prompt; a 2-block prompt chunked by the 16-token budget
MAX_NEW = 4
INIT_RANGE = 0.1  # weights' std (fixtures' default 0.5 makes bf16 routing chaotic, see above)
MAX_REL_ERR = 0.03  # relative Frobenius error of a step's logits against float32
MAX_DEVIATION = 0.06  # largest |logit - float32 logit|: 1.5x the largest measured (0.039)
MIN_GREEDY_ROWS = 3  # greedy picks compared (clear of a near tie), of 9 per model
BF16_EPS = 2.0**-8


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(42)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _run(ckpt, backend: str, dtype: str, forced: list[torch.Tensor] | None = None
         ) -> list[torch.Tensor]:  # fmt: skip
    """The logits of every step of greedy decoding, [rows, vocab] float64 each; with `forced`
    (per step, the token id of each row) the sampler takes those tokens instead of its own
    picks (teacher forcing: every run then attends the same tokens)."""
    llm = LLM(model=str(ckpt), dtype=dtype, max_model_len=64, max_num_batched_tokens=16,
              kernel_backend=backend)  # fmt: skip
    captured: list[torch.Tensor] = []
    compute = llm.engine.model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        step = len(captured)
        captured.append(logits.double())
        if forced is None or logits.numel() == 0:
            return logits
        logits = logits.clone()
        logits[torch.arange(logits.shape[0]), forced[step]] = logits.max() + 1
        return logits

    llm.engine.model.compute_logits = capture
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    llm.generate(_prompts(), params, use_tqdm=False)
    return captured


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss", "deepseek_v2"])
def test_bf16_checkpoint_triton_matches_torch(kind, tiny_ckpt_root, monkeypatch) -> None:
    monkeypatch.setenv("MOE_ENGINE_FORCE_BF16", "1")  # bf16 compute on any CPU
    ckpt = make_tiny_checkpoint(kind, tiny_ckpt_root, dtype=torch.bfloat16,
                                initializer_range=INIT_RANGE)  # fmt: skip
    ref = _run(ckpt, "torch", "float32")
    path = [x.argmax(-1) for x in ref]  # the float32 greedy path, forced on the bf16 runs
    runs = {backend: _run(ckpt, backend, "auto", path) for backend in ("torch", "triton")}
    assert (
        [x.shape for x in runs["torch"]]
        == [x.shape for x in runs["triton"]]
        == [x.shape for x in ref]
    )  # the same steps, rows in the same order
    compared = 0
    for step, (want, a, b) in enumerate(zip(ref, runs["torch"], runs["triton"], strict=True)):
        err_torch, err_triton = _rel(a, want), _rel(b, want)
        top2 = want.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        deviation = max(float((x - want).abs().max()) for x in (a, b))
        print(f"{kind} step {step}: rel err torch {err_torch:.2e}, triton {err_triton:.2e}; "
              f"max |logit - float32| {deviation:.3f}, fp32 top-2 margins "
              f"{[round(m, 3) for m in margin.tolist()]}")  # fmt: skip
        assert err_triton < 2 * err_torch + BF16_EPS, (step, err_torch, err_triton)
        assert max(err_torch, err_triton) < MAX_REL_ERR, (step, err_torch, err_triton)
        assert deviation < MAX_DEVIATION, (step, deviation)
        clear = margin > 2 * MAX_DEVIATION  # no deviation within the bound can flip these
        assert bool((b.argmax(-1) == a.argmax(-1))[clear].all()), step
        assert bool((b.argmax(-1) == path[step])[clear].all()), step
        compared += int(clear.sum())
    assert compared >= MIN_GREEDY_ROWS, f"only {compared} greedy picks clear of a near tie"
