// The C ABI of the native CPU kernels, built by kernels/native/library.py.
//
// kernels/native/binding.py generates the Python module's functions from the prototypes below
// (one per MOE_ENGINE_API declaration, same name and argument order), so each prototype is
// written once; keep their parameters to pointers, int32_t, int64_t and float.
//
// Every tensor is a raw pointer to contiguous memory (unless strides are given) plus its sizes;
// dtype flags say float32 (0) or bfloat16 (1). The Python wrappers (kernels/moe/native.py,
// cpu_linear.py, cpu_attention.py, cpu_ops.py) check shapes, dtypes and contiguity before the
// call, allocate the outputs with torch and pass `threads` = torch.get_num_threads(), the most
// threads (the caller included) of csrc/thread_pool.h's pool that a call uses.
//
// Return value: kOk, or kBadArgument (a value the Python side cannot check without reading
// tensor contents, e.g. a sequence length beyond its block table), or kOutOfMemory.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
#define MOE_ENGINE_API extern "C" __attribute__((visibility("default")))
#else
#define MOE_ENGINE_API __attribute__((visibility("default")))
#endif

enum { kOk = 0, kBadArgument = 1, kOutOfMemory = 2 };

// Version of this ABI (bumped when a prototype changes).
MOE_ENGINE_API int32_t moe_engine_abi_version(void);

// The vector width the library was built for, in bits: 256 (the AVX2 variant) or 512 (the
// AVX-512 one; kernels/native/build.py ISA_FLAGS).
MOE_ENGINE_API int32_t moe_engine_vector_bits(void);

// csrc/moe_cpu.cpp. hidden [T, H]; w13 packed [E, 2, Ip/16, H, 16], w2 [E, Hp/16, I, 16]
// (float32, or bfloat16 when w_bf16); topk_weights [T, k] float32; topk_ids [T, k] int32, or
// int64 when ids_int64 (ids outside [0, E) skipped); b13 [E, 2I] / b2 [E, H] float32 or both
// null; out [T, H] in hidden's dtype (every row written).
MOE_ENGINE_API int32_t moe_fused_moe(const void* hidden, int32_t hidden_bf16, int64_t T,
                                     int64_t H, const void* w13, const void* w2, int32_t w_bf16,
                                     int64_t E, int64_t I, int64_t Ip, int64_t Hp,
                                     const float* topk_weights, const void* topk_ids,
                                     int32_t ids_int64, int64_t k, const float* b13,
                                     const float* b2, int32_t clamped, float alpha,
                                     int32_t has_limit, float limit, void* out, int32_t threads);

// csrc/moe_cpu.cpp, 4-bit experts. codes13 [E, 2, Ip/16, H/2, 16], codes2 [E, Hp/16, I/2, 16]
// uint8; scales13 [E, 2, Ip/16, H/G, 16], scales2 [E, Hp/16, I/G, 16]: uint8 E8M0 (format 0,
// MXFP4, G = 32) or int4 scales as float32 (format 1), bfloat16 (format 2) or float16 (format
// 3); zeros13 / zeros2 uint8 like the scales (int4 asymmetric) or null (zero point 8). The rest
// as moe_fused_moe. format | 16: a bfloat16 call (hidden_bf16) with G % 16 == 0 and no zero
// points runs its products on VDPBF16PS (moe_cpu.cpp RowDot; call it so only where
// moe_bf16_dot_available() said yes; ignored otherwise and in the AVX2 build).
MOE_ENGINE_API int32_t moe_fused_moe_q4(
    const void* hidden, int32_t hidden_bf16, int64_t T, int64_t H, const uint8_t* codes13,
    const void* scales13, const uint8_t* zeros13, const uint8_t* codes2, const void* scales2,
    const uint8_t* zeros2, int32_t format, int64_t G, int64_t E, int64_t I, int64_t Ip,
    int64_t Hp, const float* topk_weights, const void* topk_ids, int32_t ids_int64, int64_t k,
    const float* b13, const float* b2, int32_t clamped, float alpha, int32_t has_limit,
    float limit, void* out, int32_t threads);

// csrc/linear_cpu.cpp. x [M, K] float32; w packed [ceil(N/16), K, 16] (float32, or bfloat16
// when w_bf16); bias [N] float32 or null; y [M, N] float32, or bfloat16 when y_bf16.
MOE_ENGINE_API int32_t moe_linear(const float* x, int64_t M, int64_t K, const void* w,
                                  int32_t w_bf16, int64_t N, const float* bias, void* y,
                                  int32_t y_bf16, int32_t threads);

// csrc/linear_q4_cpu.cpp. x [M, K] float32, or bfloat16 when x_bf16; codes [ceil(N/16), K/2, 16]
// uint8 and scales / zeros [ceil(N/16), K/G, 16] as moe_fused_moe_q4's (format, G alike);
// bias [N] float32 or null; y [M, N] float32, or bfloat16 when y_bf16. format | 16: up to 8
// bfloat16 rows with G % 16 == 0 and no zero points run their products on VDPBF16PS (call it so
// only where moe_bf16_dot_available() said yes; ignored otherwise and in the AVX2 build).
MOE_ENGINE_API int32_t moe_linear_q4(const void* x, int32_t x_bf16, int64_t M, int64_t K,
                                     const uint8_t* codes, const void* scales,
                                     const uint8_t* zeros, int32_t format, int64_t G, int64_t N,
                                     const float* bias, void* y, int32_t y_bf16,
                                     int32_t threads);

// csrc/paged_attention.cpp. q [B, Hq, D] (float32, or bfloat16 when q_bf16); k_cache, v_cache
// [num_blocks, block_size, Hkv, D] (float32, or bfloat16 when cache_bf16); block_tables [B, W]
// int64; seq_lens [B] int64 (kBadArgument unless each is in [1, W * block_size]); sinks [Hq]
// float32 or null; window 0 for full attention; amx 1: the caller allows the AMX kernels
// (moe_amx_available() said yes), and bfloat16 q and cache with amx_scores_fit shapes
// (amx_attention.h) take their scores on tiles; amx 2: the AVX512-BF16 ones
// (moe_bf16_dot_available() said yes) for dot_scores_fit shapes (bf16_dot.h); 0: float32 FMA
// scores; out [B, Hq, D] in q's dtype.
MOE_ENGINE_API int32_t moe_paged_decode_attention(
    const void* q, int32_t q_bf16, const void* k_cache, const void* v_cache, int32_t cache_bf16,
    const int64_t* block_tables, int64_t W, const int64_t* seq_lens, const float* sinks,
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, int64_t window,
    float scale, int32_t amx, void* out, int32_t threads);

// csrc/prefill_attention.cpp (AVX512-BF16; moe_bf16_dot_available() must have said yes):
// causal attention of a batch of prefill chunks over their requests' cached keys. q [T, Hq, D]
// bfloat16 (request b's Lq = query_start_loc[b + 1] - query_start_loc[b] query tokens from
// row query_start_loc[b], at positions seq_lens[b] - Lq ..); k_cache, v_cache [num_blocks,
// block_size, Hkv, D] bfloat16 holding every request's keys (this step's included);
// block_tables [B, W] int64; seq_lens [B] int64 in [1, W * block_size] and Lq in [0, seq_len]
// (else kBadArgument); sinks [Hq] float32 or null; window 0 for full attention; D a multiple of
// 32 up to 256 and Hq / Hkv <= 16 (else kBadArgument); out [T, Hq, D] bfloat16 (rows of
// every query written).
MOE_ENGINE_API int32_t moe_prefill_attention(
    const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
    int64_t W, const int64_t* seq_lens, const int64_t* query_start_loc, const float* sinks,
    int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size, int64_t window,
    float scale, void* out, int32_t threads);

// csrc/ops_cpu.cpp. x: A x B rows of D values (row (a, b) at x + a * sa + b * sb elements),
// float32, or bfloat16 when bf16; weight [D] of x's dtype; y [A * B, D] contiguous, x's dtype.
MOE_ENGINE_API int32_t moe_rms_norm(const void* x, int64_t A, int64_t B, int64_t D, int64_t sa,
                                    int64_t sb, const void* weight, float eps,
                                    int32_t weight_in_float32, int32_t bf16, void* y,
                                    int32_t threads);

// csrc/ops_cpu.cpp: softmax-then-top-k routing. logits [T, E] (float32, or bfloat16 when bf16,
// contiguous); softmax in float32, then the k largest probabilities in descending order, the
// lower index first among equal values and NaN above every number (the first k of a stable
// descending sort: torch.sort(descending=True, stable=True)), then (renormalize) divided by
// their sum. weights [T, k] float32, ids [T, k] int32; 1 <= k <= E <=
// 4096, else kBadArgument.
MOE_ENGINE_API int32_t moe_router_softmax_topk(const void* logits, int32_t bf16, int64_t T,
                                               int64_t E, int64_t k, int32_t renormalize,
                                               float* weights, int32_t* ids, int32_t threads);

// csrc/rope_cpu.cpp: the attention prologue of one layer. qkv [T, (Hq + 2 Hkv) D] (q heads,
// then k heads, then v heads; float32, or bfloat16 when bf16); positions [T] int64 (each in
// [0, P), else kBadArgument); cos, sin [P, D] float32 (the rotate-half tables); q_norm, k_norm
// [D] of qkv's dtype, or both null (no q/k RMSNorm); k_cache, v_cache [S, Hkv, D] slots of
// qkv's dtype; slot_mapping [T] int64 (each in [0, S), else kBadArgument). Writes the rotated
// (normalised) q to q_out [T, Hq, D] and the rotated k and the v of token t to slot
// slot_mapping[t] of the caches.
MOE_ENGINE_API int32_t moe_qk_norm_rope_cache(
    const void* qkv, int32_t bf16, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
    const int64_t* positions, const float* cos, const float* sin, int64_t P, const void* q_norm,
    const void* k_norm, float eps, void* k_cache, void* v_cache, int64_t S,
    const int64_t* slot_mapping, void* q_out, int32_t threads);

// csrc/amx_detect.cpp: 0 when this process may run the AMX kernels below (CPU has AMX-TILE
// and AMX-BF16; the OS enables their state; Linux granted the tile data state, asked for on
// the first call), else why not: 1 no AMX-BF16, 3 the OS does not enable the state, 4 the
// tile data permission was refused. Call before any moe_amx_* kernel.
MOE_ENGINE_API int32_t moe_amx_available(void);

// csrc/bf16_dot.cpp: 0 when this CPU and OS run the AVX512-BF16 (VDPBF16PS) blocks that the
// kernels below take with `tiles` 0 (CPUID AVX512F, AVX512BW and AVX512_BF16; XCR0 saving the
// opmask and zmm state), else 1. Call before any of them with tiles 0.
MOE_ENGINE_API int32_t moe_bf16_dot_available(void);

// csrc/amx_gemm.cpp. x [M, K] bfloat16, K % 32 == 0 (else kBadArgument); w packed VNNI
// [ceil(N/16), K/2, 16, 2] bfloat16 (kernels/dense/amx.py pack_vnni); bias [N] float32 or null,
// added to the float32 sums before the one rounding; y [M, N] float32, or bfloat16 when y_bf16.
// tiles nonzero: on the AMX tiles (moe_amx_available() said yes); 0: the same products and
// sums on AVX512-BF16 (moe_bf16_dot_available() said yes). The same holds for the `tiles` of
// moe_amx_fused_moe and moe_decode_layer.
MOE_ENGINE_API int32_t moe_amx_linear(const void* x, int64_t M, int64_t K, const void* w,
                                      int64_t N, const float* bias, void* y, int32_t y_bf16,
                                      int32_t tiles, int32_t threads);

// csrc/amx_moe.cpp, bfloat16 experts on AMX. hidden [T, H] bfloat16; w13 packed VNNI [E, 2,
// ceil(I/16), ceil(H/32) * 16, 16, 2] (gate tiles, then up tiles), w2 [E, ceil(H/16),
// ceil(I/32) * 16, 16, 2] bfloat16 (kernels/dense/amx.py pack_vnni, K zero-padded); the rest as
// moe_fused_moe; out [T, H] bfloat16 (every row written).
MOE_ENGINE_API int32_t moe_amx_fused_moe(const void* hidden, int64_t T, int64_t H,
                                         const void* w13, const void* w2, int64_t E, int64_t I,
                                         const float* topk_weights, const void* topk_ids,
                                         int32_t ids_int64, int64_t k, const float* b13,
                                         const float* b2, int32_t clamped, float alpha,
                                         int32_t has_limit, float limit, void* out,
                                         int32_t tiles, int32_t threads);

// csrc/decode_layer.cpp: one pre-norm MoE decoder layer of a decode step (T requests, one token
// each), bfloat16 throughout, as the calls above in order: h [T, H] (the residual stream,
// updated in place); norm1, norm2 [H] (the layer's two RMSNorms, epsilon eps, the weight
// multiplied in float32 when norm_in_float32, as moe_rms_norm's weight_in_float32); w_qkv
// packed for moe_amx_linear ([ceil(N/16), H/2, 16, 2], N = (Hq + 2 Hkv) D), b_qkv [N] or null;
// the prologue's arguments as moe_qk_norm_rope_cache (q_norm/k_norm may be null); the
// attention's as moe_paged_decode_attention (sinks [Hq] float32 or null; B = T); w_o packed
// [ceil(H/16), Hq D/2, 16, 2], b_o [H] or null; w_router packed [ceil(E/16), H/2, 16, 2],
// b_router [E] float32 or null; the routing as moe_router_softmax_topk, or, when
// topk_softmax, as moe_router_topk_softmax (renormalize unused; k and E as it takes them, else
// kBadArgument), written to topk_weights [T, k] float32 and topk_ids [T, k] int32; the experts
// as moe_amx_fused_moe (w13, w2) or, when q4, as moe_fused_moe_q4 (codes13 ... Hp; w13/w2
// unused), with b13 / b2 and the activation (clamped ... limit) as those take them;
// qkv_format / o_format -1 for the AMX-packed w_qkv / w_o above, or moe_linear_q4's format
// when they are 4-bit tiles instead (w_qkv / w_o the codes, qkv_scales / o_scales the scales,
// qkv_G / o_G the groups; symmetric); tiles as moe_amx_linear (and the attention's scores on
// the tiles, amx 1, or on AVX512-BF16, amx 2). Shapes are checked by
// kernels/decode_layer/native.py.
MOE_ENGINE_API int32_t moe_decode_layer(
    void* h, int64_t T, int64_t H, const void* norm1, const void* norm2, float eps,
    int32_t norm_in_float32, const void* w_qkv, const float* b_qkv, int64_t Hq, int64_t Hkv,
    int64_t D, const int64_t* positions, const float* cos, const float* sin, int64_t P,
    const void* q_norm, const void* k_norm, float qk_eps, void* k_cache, void* v_cache,
    int64_t S, const int64_t* slot_mapping, const int64_t* block_tables, int64_t W,
    const int64_t* seq_lens, int64_t block_size, int64_t window, float scale,
    const float* sinks, const void* w_o, const float* b_o, const void* w_router,
    const float* b_router, int64_t E, int64_t k, int32_t renormalize, int32_t topk_softmax,
    const void* w13, const void* w2, int64_t I, int32_t q4, const uint8_t* codes13,
    const void* scales13, const uint8_t* zeros13, const uint8_t* codes2, const void* scales2,
    const uint8_t* zeros2, int32_t format, int64_t G, int64_t Ip, int64_t Hp, const float* b13,
    const float* b2, int32_t clamped, float alpha, int32_t has_limit, float limit,
    float* topk_weights, int32_t* topk_ids, int32_t qkv_format, const void* qkv_scales,
    int64_t qkv_G, int32_t o_format, const void* o_scales, int64_t o_G, int32_t tiles,
    int32_t threads);

// csrc/decode_layer.cpp: gpt-oss's top-k-then-softmax routing as transformers computes it on a
// CPU in bfloat16 (`torch.topk(logits, k)`, then softmax in bfloat16), bit for bit, ties
// included (ATen's selection for k * 64 > E: std::nth_element, then std::sort of the first
// k - 1). logits [T, E] bfloat16 contiguous; 1 <= k <= 7 and k * 64 > E, else kBadArgument;
// weights [T, k] float32 (the bfloat16 softmax widened), ids [T, k] int32. One thread.
MOE_ENGINE_API int32_t moe_router_topk_softmax(const void* logits, int64_t T, int64_t E,
                                               int64_t k, float* weights, int32_t* ids);

// csrc/repack.cpp: expert weights into the fused MoE kernels' tiles at load time. experts [E]
// holds each expert's address (as int64); row n of expert e starts row_stride bytes after row
// n - 1. Tile t of expert e (rows 16t .. 16t + 15, rows past N zero) goes to dst +
// e * dst_expert_stride + t * tile bytes. moe_pack_q4_tiles: rows of K 4-bit codes (K/2 bytes,
// code 2j in byte j's low nibble), K even; tiles [K/2, 16] bytes in moe_fused_moe_q4's nibble
// order. moe_pack_tiles: rows of K elements of elem_bytes (1, 2 or 4) bytes; tiles [K, 16].
MOE_ENGINE_API int32_t moe_pack_q4_tiles(const int64_t* experts, int64_t E, int64_t N, int64_t K,
                                         int64_t row_stride, void* dst,
                                         int64_t dst_expert_stride, int32_t threads);
MOE_ENGINE_API int32_t moe_pack_tiles(const int64_t* experts, int64_t E, int64_t N, int64_t K,
                                      int64_t elem_bytes, int64_t row_stride, void* dst,
                                      int64_t dst_expert_stride, int32_t threads);
