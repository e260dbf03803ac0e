"""kernels.attention.gated_delta: the chunked and recurrent gated delta rule against a float64
per-token
reference and against transformers' qwen3_next torch path; the causal conv1d in pieces."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from kernels.attention.gated_delta import (
    causal_conv1d_decode,
    causal_conv1d_prefill,
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule,
)

# The plain torch functions, not a hub / FLA kernel the decorators might route to.
hf_chunk = inspect.unwrap(hf.torch_chunk_gated_delta_rule)
hf_recurrent = inspect.unwrap(hf.torch_recurrent_gated_delta_rule)
hf_conv_fn = inspect.unwrap(hf.causal_conv1d_fn)
hf_conv_update = inspect.unwrap(hf.causal_conv1d_update)

DK, DV = 16, 8


def make_inputs(t: int, hk: int, hv: int, seed: int, batch: tuple[int, ...] = ()) -> tuple:
    """Random q, k [*batch, t, hk, DK], v [*batch, t, hv, DV], g, beta [*batch, t, hv]."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(*batch, t, hk, DK, generator=gen)
    k = torch.randn(*batch, t, hk, DK, generator=gen)
    v = torch.randn(*batch, t, hv, DV, generator=gen)
    g = F.logsigmoid(torch.randn(*batch, t, hv, generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(*batch, t, hv, generator=gen))
    return q, k, v, g, beta


def rand_state(hv: int, seed: int, batch: tuple[int, ...] = ()) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 0.5 * torch.randn(*batch, hv, DK, DV, generator=gen)


def reference(q, k, v, g, beta, state=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 per-token gated delta rule for one sequence: [T, H, D] in, ([T, Hv, Dv], S)."""
    hv = v.shape[1]
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q = q.repeat_interleave(hv // q.shape[1], dim=1)
    k = k.repeat_interleave(hv // k.shape[1], dim=1)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * DK**-0.5
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    s = torch.zeros(hv, DK, DV, dtype=torch.float64) if state is None else state.double().clone()
    outs = []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        err = v[t] - (s * k[t][:, :, None]).sum(1)
        s = s + k[t][:, :, None] * (beta[t][:, None] * err)[:, None, :]
        outs.append((s * q[t][:, :, None]).sum(1))
    return torch.stack(outs), s


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


def test_l2norm_matches_transformers():
    x = torch.randn(5, 3, DK)
    assert torch.equal(l2norm(x), hf.l2norm(x, dim=-1, eps=1e-6))


@pytest.mark.parametrize("t", [1, 63, 64, 65, 150])
@pytest.mark.parametrize("hk,hv", [(2, 2), (2, 6)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_reference(t, hk, hv, with_state):
    q, k, v, g, beta = make_inputs(t, hk, hv, seed=t * 7 + hv)
    state0 = rand_state(hv, seed=t) if with_state else None
    state_copy = None if state0 is None else state0.clone()
    ref_out, ref_state = reference(q, k, v, g, beta, state0)
    for chunk_size in (16, 64):
        out, state = chunk_gated_delta_rule(q, k, v, g, beta, state0, chunk_size=chunk_size)
        assert out.shape == (t, hv, DV) and out.dtype == torch.float32
        assert state.shape == (hv, DK, DV) and state.dtype == torch.float32
        close(out, ref_out)
        close(state, ref_state)
    if state0 is not None:
        assert torch.equal(state0, state_copy)  # the initial state is not modified


def test_split_chunks_then_decode_match_reference():
    hk, hv, sizes, decode_steps = 2, 4, [37, 1, 80], 5
    total = sum(sizes) + decode_steps
    q, k, v, g, beta = make_inputs(total, hk, hv, seed=11)
    ref_out, ref_state = reference(q, k, v, g, beta)
    prefill = sum(sizes)
    whole_out, whole_state = chunk_gated_delta_rule(
        q[:prefill], k[:prefill], v[:prefill], g[:prefill], beta[:prefill], None, chunk_size=32
    )
    state, start, outs = None, 0, []
    for n in sizes:
        sl = slice(start, start + n)
        out, state = chunk_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], state, 32)
        outs.append(out)
        start += n
    close(torch.cat(outs), whole_out)
    close(state, whole_state)
    close(torch.cat(outs), ref_out[:prefill])
    batched = state.unsqueeze(0).clone()
    for t in range(prefill, total):
        sl = slice(t, t + 1)
        out = recurrent_gated_delta_rule(q[sl], k[sl], v[sl], g[sl], beta[sl], batched)
        close(out[0], ref_out[t])
    close(batched[0], ref_state)


def test_recurrent_batched_in_place():
    b, hk, hv, steps = 3, 2, 4, 4
    q, k, v, g, beta = make_inputs(steps, hk, hv, seed=5, batch=(b,))
    state0 = rand_state(hv, seed=6, batch=(b,))
    pool = torch.zeros(b + 2, hv, DK, DV)
    pool[1 : b + 1] = state0
    view = pool[1 : b + 1]  # a view: the update must land in the pool
    for t in range(steps):
        out = recurrent_gated_delta_rule(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], view)
        assert out.shape == (b, hv, DV) and out.dtype == torch.float32
        for r in range(b):
            ref_out, ref_state = reference(
                q[r, : t + 1],
                k[r, : t + 1],
                v[r, : t + 1],
                g[r, : t + 1],
                beta[r, : t + 1],
                state0[r],
            )
            close(out[r], ref_out[-1])
            close(pool[1 + r], ref_state)
    assert torch.equal(pool[0], torch.zeros_like(pool[0]))
    assert torch.equal(pool[-1], torch.zeros_like(pool[-1]))


@pytest.mark.parametrize("t,chunk_size", [(1, 64), (65, 64), (150, 64), (100, 16)])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_matches_transformers(t, chunk_size, with_state):
    hk, hv = 2, 4
    q, k, v, g, beta = make_inputs(t, hk, hv, seed=t + 100)
    state0 = rand_state(hv, seed=t + 1) if with_state else None
    out, state = chunk_gated_delta_rule(q, k, v, g, beta, state0, chunk_size=chunk_size)
    hf_out, hf_state = hf_chunk(
        q[None],
        k[None],
        v[None],
        g[None],
        beta[None],
        chunk_size=chunk_size,
        initial_state=None if state0 is None else state0[None],
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    close(out, hf_out[0])
    close(state, hf_state[0])


def test_recurrent_matches_transformers():
    b, hk, hv = 3, 2, 4
    q, k, v, g, beta = make_inputs(1, hk, hv, seed=21, batch=(b,))
    state0 = rand_state(hv, seed=22, batch=(b,))
    hf_out, hf_state = hf_recurrent(
        q,
        k,
        v,
        g,
        beta,
        initial_state=state0.clone(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    state = state0.clone()
    out = recurrent_gated_delta_rule(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state)
    close(out, hf_out[:, 0])
    close(state, hf_state)


def test_bf16_inputs_keep_dtype():
    q, k, v, g, beta = make_inputs(20, 2, 4, seed=3)
    qb, kb, vb = (x.bfloat16() for x in (q, k, v))
    out, state = chunk_gated_delta_rule(qb, kb, vb, g, beta.bfloat16(), None, chunk_size=16)
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    ref_out, _ = reference(qb, kb, vb, g, beta.bfloat16())
    close(out, ref_out, tol=2e-2)
    step = recurrent_gated_delta_rule(qb[:1], kb[:1], vb[:1], g[:1], beta[:1], state[None])
    assert step.dtype == torch.bfloat16


def conv_params(c: int, w: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(c, w, generator=gen), torch.randn(c, generator=gen)


@pytest.mark.parametrize("pieces", [[1], [2, 9], [1, 2, 1, 7, 3]])
@pytest.mark.parametrize("use_bias", [True, False])
def test_conv_prefill_pieces_match_whole(pieces, use_bias):
    c, w = 6, 4
    weight, bias = conv_params(c, w, seed=len(pieces))
    bias = bias if use_bias else None
    x = torch.randn(sum(pieces), c)
    expected = hf_conv_fn(x.t()[None], weight, bias, activation="silu")[0].t()
    state, start, outs = torch.zeros(c, w - 1), 0, []
    for n in pieces:
        outs.append(causal_conv1d_prefill(x[start : start + n], state, weight, bias))
        start += n
    close(torch.cat(outs), expected, tol=1e-6)
    last = torch.cat([torch.zeros(c, w - 1), x.t()], dim=-1)[:, -(w - 1) :]
    assert torch.equal(state, last)


def test_conv_decode_matches_update_and_prefill():
    b, c, w = 3, 5, 4
    weight, bias = conv_params(c, w, seed=9)
    pool = torch.randn(b + 1, c, w - 1)
    view = pool[1:]
    hf_state = view.clone()
    for _ in range(3):
        x = torch.randn(b, c)
        expected = hf_conv_update(x[..., None], hf_state, weight, bias, activation="silu")[..., 0]
        out = causal_conv1d_decode(x, view, weight, bias)
        close(out, expected, tol=1e-6)
        assert torch.equal(pool[1:], hf_state)
    # Decode continues a prefill state: same as prefilling the token.
    state = pool[1].clone()
    x = torch.randn(1, c)
    pre = causal_conv1d_prefill(x, state, weight, bias)
    dec = causal_conv1d_decode(x, pool[1:2], weight, bias)
    close(pre, dec, tol=1e-6)
    assert torch.equal(state, pool[1])
