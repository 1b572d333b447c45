// Over 400 lines: one extension, compiled once per machine class; its kernels share the block formats and the vector helpers.
// CPU kernels for decode and verify steps: weight-block matrix products for a few rows, and attention
// over each query's exact visible keys. Built by `make setup` (engine/runtime/kernels.py); without a compiler the
// engine runs its eager paths instead.
//
// Both keep one promise: a row's result depends on that row's inputs only, computed by the same
// instructions in the same order whatever the number of rows beside it. A verify step's row therefore
// equals the decode step of the same position bit for bit, which is what makes speculation lossless
// against the same engine's own plain decoding.

#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include <sys/syscall.h>
#include <unistd.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int GROUP = 32;  // weights per block (ggml's QK4_0, QK4_1, QK8_0)

// ---------------------------------------------------------------------------------------------
// Activations, optionally RMS-normalized first (x / sqrt(mean(x^2) + eps) * norm, the layer's norm fused
// into its product) or, with silu_mul, a row [gate, up] of twice the width made silu(gate) * up (the MLP's
// activation fused into its down product), then quantized per row and group of 32 (ggml's Q8_1):
// x ~= dx * xq, xq in -127..127, and the group's sum dx * sum(xq), which the weights' offset m multiplies;
// where xh is given, also the integer sums of xq per 16 (two a group: Q6_K's sub-blocks take them).

void quantize_rows(const float* x, int64_t rows, int64_t in, const float* norm, float eps, bool silu_mul,
                   int8_t* xq, float* dx, float* xs, int32_t* xh) {
  const int64_t stride = silu_mul ? 2 * in : in;
  const int64_t groups = in / GROUP;
  std::vector<float> row_scale(rows, 1.f);
  if (norm != nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      float lanes[8] = {0.f};  // a fixed lane structure: the same sum for every row and call
      for (int64_t c = 0; c < in; c += 8)
        for (int l = 0; l < 8; ++l) lanes[l] += x[r * stride + c + l] * x[r * stride + c + l];
      const float ss = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
      row_scale[r] = 1.f / std::sqrt(ss / static_cast<float>(in) + eps);
    }
  }
  at::parallel_for(0, rows * groups, 64, [&](int64_t begin, int64_t end) {
    float v[GROUP];
    for (int64_t i = begin; i < end; ++i) {
      const int64_t r = i / groups, c = (i % groups) * GROUP;
      const float* src = x + r * stride + c;
      const float scale = row_scale[r];
      const float* w = norm != nullptr ? norm + c : nullptr;
      float amax = 0.f;
      for (int j = 0; j < GROUP; ++j) {
        if (silu_mul)
          v[j] = src[j] / (1.f + std::exp(-src[j])) * src[in + j];
        else
          v[j] = w != nullptr ? src[j] * scale * w[j] : src[j];
        amax = std::fmax(amax, std::fabs(v[j]));
      }
      const float d = amax / 127.f;
      const float inv = d != 0.f ? 1.f / d : 0.f;
      int32_t half[2] = {0, 0};
      for (int j = 0; j < GROUP; ++j) {
        const int8_t q = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        xq[i * GROUP + j] = q;
        half[j / 16] += q;
      }
      dx[i] = d;
      xs[i] = d * static_cast<float>(half[0] + half[1]);
      if (xh != nullptr) {
        xh[2 * i] = half[0];
        xh[2 * i + 1] = half[1];
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Weights, repacked at load (engine/runtime/linear.py, BlockLinear) so that one 32-bit lane holds one output:
// for each block of LANES outputs and each group g, 8 vectors w_j (j = 0..7) of 4 * LANES bytes, whose
// lane i holds elements 4j..4j+3 of output i's group. 4-bit weights (q in 0..15) are stored two vectors
// to one, w_2L in the low nibbles and w_2L+1 in the high; 8-bit ones one vector to one: signed with AVX2
// (and portable), offset by 128 with AVX-512 (unsigned, as its dot product takes them; m = -128 d, made
// from d as it loads, undoes it). 6-bit ones (q in 0..63) as 4-bit ones for their low 4 bits, then two
// vectors of the high 2 bits: lane i's byte b of vector h holds, at bits 2t..2t+1, those of element
// 4(4h + t) + b. The scales, per layout (`Layout`), [outputs / LANES, ..., LANES]: one output a lane.
//
// Row r's outputs then accumulate, over the groups in order and with no horizontal sum:
//   acc += d_g * dx_rg * sum_j dot(w_j, x_rg[4j..4j+3])     (an exact integer per lane)
//   acc += m_g * xs_rg
// and y = acc. A row's lanes see only that row's data, by the same instructions for every row. One
// accumulator a row leaves registers for 16 rows (AVX-512) or 8 (AVX2) to share each unpacked block:
// a verify step of up to 15 drafts reads its weights once.
//
// The layouts (the file's weights exactly: every scale below is the file's, or an exact product of its parts):
//   Q4: 4-bit q, d and m [groups, LANES] fp16 (Q4_1's d and m; Q4_0's d, m = -8 d, exact in fp16 too).
//   Q8: 8-bit q, d [groups, LANES] fp16 (Q8_0; Q5_0 as q - 16 in -16..15).
//   Q4K: 4-bit q; d [groups / 8, 2, LANES] fp16, the super-block's d and dmin; m [groups, 2, LANES] uint8,
//        the group's 6-bit sc and mn. d_g = d * sc and m_g = -dmin * mn, each exact in fp32 (11 bits of
//        mantissa times 6), as ggml computes them: the formula above.
//   Q6K: 6-bit q (0..63, the weight q - 32); d [groups / 8, LANES] fp16; m [groups, 2, LANES] int8, the two
//        sub-blocks' (16 weights each) scales sc0, sc1. The group's integer
//          isum = sc0 * (dot(w, x)[0:16] - 32 sum(xq[0:16])) + sc1 * (dot(w, x)[16:32] - 32 sum(xq[16:32]))
//        (|isum| < 2^31: 2 * 128 * 16 * 95 * 127) gives acc += isum * (d * dx_rg), from quantize_rows'
//        integer sums per 16 (xh).
//   Q5: 5-bit q (0..31, Q5_0's, the weight q - 16), 22 bytes per 32 weights as in the file: the low 4 bits as
//       4-bit weights, then one 32-bit word a lane of the high bits, whose byte b holds at bit j that of element
//       4j + b (AVX-512 tests it into a byte mask that adds 16 to w_j's byte b; AVX2 shifts and masks it to bit 4);
//       d [groups, LANES] fp16. The group's integer isum = dot(w, x) - 16 sum(xq) gives acc += isum * (d * dx_rg).
//   Q5K: 5-bit q (0..31), as Q5 for the bits; scales as Q4K's.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SPECPOOL_AVX512 1
constexpr int LANES = 16;  // outputs per block: one 512-bit vector
constexpr bool SIGNED_OFFSET = true;  // 8-bit weights stored + 128, undone by m = -128 d (made as it loads d)
#else
constexpr bool SIGNED_OFFSET = false;
constexpr int LANES = 8;  // one 256-bit vector (AVX2), or 8 scalars
#endif
#if defined(SPECPOOL_AVX512)
#define ROW_TILE_MAX 16  // rows that share one unpacking of a weight block (32 vector registers)
#else
#define ROW_TILE_MAX 8  // (16 vector registers)
#endif
constexpr int ROW_TILE = ROW_TILE_MAX;

enum Layout : int64_t { Q4 = 4, Q5 = 5, Q8 = 8, Q4K = 41, Q5K = 51, Q6K = 61 };

constexpr bool four_bit(int64_t layout) { return layout == Q4 || layout == Q4K; }
constexpr bool five_bit(int64_t layout) { return layout == Q5 || layout == Q5K; }
constexpr bool k_min(int64_t layout) { return layout == Q4K || layout == Q5K; }  // d and dmin per super-block
constexpr bool k_quant(int64_t layout) { return k_min(layout) || layout == Q6K; }
// Bytes per group of LANES outputs.
constexpr int group_bytes(int64_t layout) {
  return (four_bit(layout) ? 16 : five_bit(layout) ? 20 : layout == Q6K ? 24 : 32) * LANES;
}

#if defined(SPECPOOL_AVX512)
inline __m512i broadcast4_512(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}
#endif

#if defined(__AVX2__)
inline __m256i broadcast4(const int8_t* x) {  // 4 activation bytes into every lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

// Sum over j in [J0, J1) of lane-wise dot products of w[j] (unsigned when UNSIGNED: 0..15 or 0..63, else
// signed) and x's bytes 4j..4j+3: 8 int32 lanes.
template <bool UNSIGNED, int J0 = 0, int J1 = 8>
inline __m256i block_dot(const __m256i* w, const int8_t* x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  __m256i s = _mm256_setzero_si256();
  for (int j = J0; j < J1; ++j) {
    const __m256i xj = broadcast4(x + 4 * j);
    s = UNSIGNED ? _mm256_dpbusd_epi32(s, w[j], xj)
                 : _mm256_dpbusd_epi32(s, _mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(xj, w[j]));
  }
  return s;
#else
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i s = _mm256_setzero_si256();
  if (UNSIGNED && J1 - J0 == 8) {  // 4-bit: 16-bit partial sums, 8 * 2 * 15 * 127 fits
    __m256i s16 = _mm256_maddubs_epi16(w[0], broadcast4(x));
    for (int j = 1; j < 8; ++j) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], broadcast4(x + 4 * j)));
    return _mm256_madd_epi16(s16, ones);
  }
  if (UNSIGNED) {  // 6-bit: 16-bit partial sums of two vectors, 2 * 2 * 63 * 127 fits
    for (int j = J0; j < J1; j += 2) {
      const __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(w[j], broadcast4(x + 4 * j)),
                                           _mm256_maddubs_epi16(w[j + 1], broadcast4(x + 4 * j + 4)));
      s = _mm256_add_epi32(s, _mm256_madd_epi16(s16, ones));
    }
    return s;
  }
  for (int j = J0; j < J1; ++j) {  // signed x signed: the sign moves onto x; 2 * 128 * 127 fits 16 bits
    const __m256i xj = broadcast4(x + 4 * j);
    s = _mm256_add_epi32(s, _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_sign_epi8(w[j], w[j]), _mm256_sign_epi8(xj, w[j])), ones));
  }
  return s;
#endif
}
#endif

// One block of LANES outputs: its packed weights and scales (pointers at its first group).
struct Block {
  const uint8_t* qs;
  const at::Half* d;
  const void* m;
};

#if defined(__AVX2__)
// The weights PREFETCH_GROUPS groups ahead, into L1: a decode step streams them from memory once, and the
// hardware's prefetchers alone left it waiting on them. Qwen2.5-Coder-1.5B Q4_K_M, 1 thread: a 1-row step
// 92 -> 68 ms, a 9-row one 143 -> 104 ms (24 groups ahead; 48 and 96 measured the same). Addresses past the
// last block are harmless (a prefetch never faults), so they are computed as integers, not pointers. Both vector
// paths prefetch.
constexpr int64_t PREFETCH_GROUPS = 24;
template <int64_t LAYOUT>
inline void prefetch_group(const uint8_t* qs, int64_t g) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(qs) + static_cast<uintptr_t>(g * group_bytes(LAYOUT));
  for (int line = 0; line < group_bytes(LAYOUT); line += 64) _mm_prefetch(reinterpret_cast<const char*>(at + line), _MM_HINT_T0);
}
#endif

#if defined(SPECPOOL_AVX512)
// Group g of a block, unpacked: w_j's lane i holds elements 4j..4j+3 of output i's group, unsigned.
template <int64_t LAYOUT>
inline void unpack_group(const uint8_t* block, __m512i* w) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (LAYOUT == Q8) {
    for (int k = 0; k < 8; ++k) w[k] = _mm512_loadu_si512(block + 64 * k);
  } else {
    for (int k = 0; k < 4; ++k) {
      const __m512i b = _mm512_loadu_si512(block + 64 * k);
      w[2 * k] = _mm512_and_si512(b, m4);
      w[2 * k + 1] = _mm512_and_si512(_mm512_srli_epi16(b, 4), m4);
    }
  }
  if constexpr (five_bit(LAYOUT)) {  // where bit j of byte b is set, 16 added to w_j's byte b
    const __m512i hb = _mm512_loadu_si512(block + 16 * LANES), m10 = _mm512_set1_epi8(0x10);
    for (int j = 0; j < 8; ++j)
      w[j] = _mm512_mask_add_epi8(w[j], _mm512_test_epi8_mask(hb, _mm512_set1_epi8(static_cast<char>(1 << j))), w[j], m10);
  }
  if constexpr (LAYOUT == Q6K) {  // the high 2 bits into bits 4..5 (16-bit shifts: the mask drops what crosses bytes)
    const __m512i m30 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i b = _mm512_loadu_si512(block + 256 + 64 * h);
      w[4 * h] = _mm512_or_si512(w[4 * h], _mm512_and_si512(_mm512_slli_epi16(b, 4), m30));
      w[4 * h + 1] = _mm512_or_si512(w[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(b, 2), m30));
      w[4 * h + 2] = _mm512_or_si512(w[4 * h + 2], _mm512_and_si512(b, m30));
      w[4 * h + 3] = _mm512_or_si512(w[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(b, 2), m30));
    }
  }
}

// One group's scales, a lane per output: d_g and m_g, or (Q6K) the super-block's d and the two sub-blocks' sc.
struct Scales {
  __m512 dv, mv, sc0, sc1;
};

// `super` carries a K-quant super-block's d and -dmin from its first group to the next seven.
template <int64_t LAYOUT>
inline Scales group_scales(const Block& blk, int64_t g, __m512* super) {
  const at::Half* d_half = blk.d;
  const uint8_t* m_bytes = static_cast<const uint8_t*>(blk.m);
  Scales s;
  if constexpr (LAYOUT == Q4 || LAYOUT == Q8 || LAYOUT == Q5) {
    s.dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d_half + g * LANES)));
    s.mv = LAYOUT == Q4 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                              reinterpret_cast<const at::Half*>(m_bytes) + g * LANES)))
                        : _mm512_mul_ps(s.dv, _mm512_set1_ps(-128.f));  // exact: a power of two
  } else {
    if (g % 8 == 0) {
      const at::Half* sd = d_half + g / 8 * (k_min(LAYOUT) ? 2 : 1) * LANES;
      super[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sd)));
      if constexpr (k_min(LAYOUT))  // negated: exact
        super[1] = _mm512_sub_ps(_mm512_setzero_ps(),
                                 _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sd + LANES))));
    }
    const __m128i s0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m_bytes + g * 2 * LANES));
    const __m128i s1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m_bytes + g * 2 * LANES + LANES));
    if constexpr (k_min(LAYOUT)) {
      s.dv = _mm512_mul_ps(super[0], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s0)));  // exact
      s.mv = _mm512_mul_ps(super[1], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s1)));  // exact
    } else {
      s.dv = super[0];
      s.sc0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s0));
      s.sc1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s1));
    }
  }
  return s;
}

// Layouts whose integer sums the epilogue takes centered (Q6K's weights q - 32, Q5's q - 16): AMX multiplies
// them as signed weights, and the vector path starts its sums at -32 or -16 times the activations' sums.
constexpr bool amx_centered(int64_t layout) { return layout == Q6K || layout == Q5; }

// Row r's group g added to its accumulator, from the group's integer dot products: `dot` all 32 of them
// (dot1 unused), or for Q6K `dot` its first 16 and dot1 its last; CENTERED, of the weights' signed q - 32
// (Q6K) or q - 16 (Q5) already, as AMX computes them. The only float arithmetic of a product: every path
// runs it alike, whichever instructions made the integers.
template <int64_t LAYOUT, bool CENTERED = false>
inline __m512 group_epilogue(__m512 acc, __m512i dot, __m512i dot1, const Scales& s, const float* dx,
                             const float* xs, const int32_t* xh, int64_t groups, int r, int64_t g) {
  const __m512 dxv = _mm512_mul_ps(s.dv, _mm512_set1_ps(dx[r * groups + g]));
  if constexpr (LAYOUT == Q6K) {
    // isum = sc0 * t0 + sc1 * t1 in fp32, exactly: |t| <= 16 * 32 * 127 and |sc| <= 128, so every product and
    // the sum stay below 2^24 (the bits of the integer isum converted), in fewer instructions than vpmulld.
    const int32_t* h = xh + (r * groups + g) * 2;
    const __m512 t0 = _mm512_cvtepi32_ps(CENTERED ? dot : _mm512_sub_epi32(dot, _mm512_set1_epi32(32 * h[0])));
    const __m512 t1 = _mm512_cvtepi32_ps(CENTERED ? dot1 : _mm512_sub_epi32(dot1, _mm512_set1_epi32(32 * h[1])));
    return _mm512_fmadd_ps(_mm512_fmadd_ps(t1, s.sc1, _mm512_mul_ps(t0, s.sc0)), dxv, acc);
  } else if constexpr (LAYOUT == Q5) {
    const int32_t* h = xh + (r * groups + g) * 2;
    const __m512i isum = CENTERED ? dot : _mm512_sub_epi32(dot, _mm512_set1_epi32(16 * (h[0] + h[1])));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), dxv, acc);
  } else {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dxv, acc);
    return _mm512_fmadd_ps(s.mv, _mm512_set1_ps(xs[r * groups + g]), acc);
  }
}
#endif

// Outputs of one block of LANES, for `TILE` rows; y points at row 0's first of them.
// TILE, the row count, is a template argument so that the rows' accumulators live in registers.
template <int64_t LAYOUT, int TILE>
void block_rows(const Block& blk, int64_t groups, const int8_t* xq, const float* dx, const float* xs,
                const int32_t* xh, int64_t in, const float* res, float* y, int64_t out) {
  constexpr int tile = TILE;
  constexpr int BYTES = group_bytes(LAYOUT);
  const at::Half* d_half = blk.d;
  const uint8_t* m_bytes = static_cast<const uint8_t*>(blk.m);
#if defined(SPECPOOL_AVX512)
  (void)d_half, (void)m_bytes;
  __m512 acc[TILE];
  for (int r = 0; r < TILE; ++r) acc[r] = _mm512_setzero_ps();
  __m512 super[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};  // K-quants: the super-block's d, -dmin
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_group<LAYOUT>(blk.qs, g + PREFETCH_GROUPS);
    __m512i w[8];
    unpack_group<LAYOUT>(blk.qs + g * BYTES, w);
    const Scales s = group_scales<LAYOUT>(blk, g, super);
#pragma GCC unroll 16
    for (int r = 0; r < tile; ++r) {
      const int8_t* x = xq + r * in + g * GROUP;
      // Two chains (half the latency), each started at its share of the centering (Q6K: -32 times the
      // activations' sum per 16, Q5: -16 times theirs): the integers group_epilogue takes CENTERED, exactly.
      const int32_t* h = amx_centered(LAYOUT) ? xh + (r * groups + g) * 2 : nullptr;
      __m512i s0 = LAYOUT == Q6K ? _mm512_set1_epi32(-32 * h[0]) : LAYOUT == Q5 ? _mm512_set1_epi32(-16 * (h[0] + h[1]))
                                                                                 : _mm512_setzero_si512();
      __m512i s1 = LAYOUT == Q6K ? _mm512_set1_epi32(-32 * h[1]) : _mm512_setzero_si512();
      if constexpr (LAYOUT == Q6K) {  // s0 the first 16 elements, s1 the last
        for (int j = 0; j < 4; ++j) {
          s0 = _mm512_dpbusd_epi32(s0, w[j], broadcast4_512(x + 4 * j));
          s1 = _mm512_dpbusd_epi32(s1, w[j + 4], broadcast4_512(x + 4 * j + 16));
        }
        acc[r] = group_epilogue<LAYOUT, true>(acc[r], s0, s1, s, dx, xs, xh, groups, r, g);
      } else {
        for (int j = 0; j < 8; j += 2) {
          s0 = _mm512_dpbusd_epi32(s0, w[j], broadcast4_512(x + 4 * j));
          s1 = _mm512_dpbusd_epi32(s1, w[j + 1], broadcast4_512(x + 4 * j + 4));
        }
        acc[r] = group_epilogue<LAYOUT, amx_centered(LAYOUT)>(acc[r], _mm512_add_epi32(s0, s1), s1, s, dx, xs, xh, groups, r, g);
      }
    }
  }
  for (int r = 0; r < tile; ++r)
    _mm512_storeu_ps(y + r * out, res != nullptr ? _mm512_add_ps(acc[r], _mm512_loadu_ps(res + r * out)) : acc[r]);
#elif defined(__AVX2__)
  __m256 acc[TILE];
  for (int r = 0; r < TILE; ++r) acc[r] = _mm256_setzero_ps();
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m256 super_d = _mm256_setzero_ps(), super_min = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_group<LAYOUT>(blk.qs, g + PREFETCH_GROUPS);
    __m256i w[8];
    const uint8_t* block = blk.qs + g * BYTES;
    if constexpr (LAYOUT == Q8) {
      for (int k = 0; k < 8; ++k) w[k] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * k));
    } else {
      for (int k = 0; k < 4; ++k) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * k));
        w[2 * k] = _mm256_and_si256(b, m4);
        w[2 * k + 1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
      }
    }
    if constexpr (five_bit(LAYOUT)) {
      const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16 * LANES));
      const __m256i m10 = _mm256_set1_epi8(0x10);
      for (int j = 0; j < 8; ++j)
        w[j] = _mm256_or_si256(w[j], _mm256_and_si256(j < 4 ? _mm256_slli_epi16(hb, 4 - j) : _mm256_srli_epi16(hb, j - 4), m10));
    }
    if constexpr (LAYOUT == Q6K) {
      const __m256i m30 = _mm256_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h));
        w[4 * h] = _mm256_or_si256(w[4 * h], _mm256_and_si256(_mm256_slli_epi16(b, 4), m30));
        w[4 * h + 1] = _mm256_or_si256(w[4 * h + 1], _mm256_and_si256(_mm256_slli_epi16(b, 2), m30));
        w[4 * h + 2] = _mm256_or_si256(w[4 * h + 2], _mm256_and_si256(b, m30));
        w[4 * h + 3] = _mm256_or_si256(w[4 * h + 3], _mm256_and_si256(_mm256_srli_epi16(b, 2), m30));
      }
    }
    __m256 dv, mv = _mm256_setzero_ps();
    __m256i sc0, sc1;
    if constexpr (LAYOUT == Q4 || LAYOUT == Q8 || LAYOUT == Q5) {
      dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d_half + g * LANES)));
      if constexpr (LAYOUT == Q4)
        mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
            reinterpret_cast<const at::Half*>(m_bytes) + g * LANES)));
    } else {
      if (g % 8 == 0) {
        const at::Half* sd = d_half + g / 8 * (k_min(LAYOUT) ? 2 : 1) * LANES;
        super_d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sd)));
        if constexpr (k_min(LAYOUT))
          super_min = _mm256_sub_ps(_mm256_setzero_ps(),
                                    _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sd + LANES))));
      }
      const __m128i s0 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m_bytes + g * 2 * LANES));
      const __m128i s1 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m_bytes + g * 2 * LANES + LANES));
      if constexpr (k_min(LAYOUT)) {
        dv = _mm256_mul_ps(super_d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s0)));
        mv = _mm256_mul_ps(super_min, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s1)));
      } else {
        dv = super_d;
        sc0 = _mm256_cvtepi8_epi32(s0);
        sc1 = _mm256_cvtepi8_epi32(s1);
      }
    }
#pragma GCC unroll 16
    for (int r = 0; r < tile; ++r) {
      const int8_t* x = xq + r * in + g * GROUP;
      const __m256 dxv = _mm256_mul_ps(dv, _mm256_set1_ps(dx[r * groups + g]));
      if constexpr (LAYOUT == Q6K) {
        const int32_t* h = xh + (r * groups + g) * 2;
        const __m256i t0 = _mm256_sub_epi32(block_dot<true, 0, 4>(w, x), _mm256_set1_epi32(32 * h[0]));
        const __m256i t1 = _mm256_sub_epi32(block_dot<true, 4, 8>(w, x), _mm256_set1_epi32(32 * h[1]));
        const __m256i isum = _mm256_add_epi32(_mm256_mullo_epi32(sc0, t0), _mm256_mullo_epi32(sc1, t1));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dxv, acc[r]);
      } else if constexpr (five_bit(LAYOUT)) {  // in two halves: 16-bit partial sums of 8 vectors could overflow
        __m256i isum = _mm256_add_epi32(block_dot<true, 0, 4>(w, x), block_dot<true, 4, 8>(w, x));
        if constexpr (LAYOUT == Q5) {
          const int32_t* h = xh + (r * groups + g) * 2;
          isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(16 * (h[0] + h[1])));
        }
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), dxv, acc[r]);
        if constexpr (LAYOUT == Q5K) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * groups + g]), acc[r]);
      } else {
        const __m256 isum = _mm256_cvtepi32_ps(block_dot<four_bit(LAYOUT)>(w, x));
        acc[r] = _mm256_fmadd_ps(isum, dxv, acc[r]);
        if constexpr (four_bit(LAYOUT)) acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xs[r * groups + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < tile; ++r)
    _mm256_storeu_ps(y + r * out, res != nullptr ? _mm256_add_ps(acc[r], _mm256_loadu_ps(res + r * out)) : acc[r]);
#else
  // Portable: the same sums, one lane at a time.
  for (int r = 0; r < tile; ++r) {
    for (int i = 0; i < LANES; ++i) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* block = blk.qs + g * BYTES;
        const int8_t* x = xq + r * in + g * GROUP;
        int32_t half[2] = {0, 0};
        for (int j = 0; j < 8; ++j)
          for (int b = 0; b < 4; ++b) {
            const int byte = 4 * LANES * (LAYOUT == Q8 ? j : j / 2) + 4 * i + b;
            int q = LAYOUT == Q8 ? static_cast<int8_t>(block[byte]) : j % 2 ? block[byte] >> 4 : block[byte] & 0x0F;
            if (five_bit(LAYOUT)) q |= (block[16 * LANES + 4 * i + b] >> j & 1) << 4;
            if (LAYOUT == Q6K) q |= (block[16 * LANES + 4 * LANES * (j / 4) + 4 * i + b] >> (2 * (j % 4)) & 3) << 4;
            half[j / 4] += q * x[4 * j + b];
          }
        const float dxg = dx[r * groups + g];
        if constexpr (LAYOUT == Q5) {
          const int32_t* h = xh + (r * groups + g) * 2;
          acc += static_cast<float>(d_half[g * LANES + i]) * dxg * static_cast<float>(half[0] + half[1] - 16 * (h[0] + h[1]));
        } else if constexpr (LAYOUT == Q4 || LAYOUT == Q8) {
          acc += static_cast<float>(d_half[g * LANES + i]) * dxg * static_cast<float>(half[0] + half[1]);
          if constexpr (LAYOUT == Q4)
            acc += static_cast<float>(reinterpret_cast<const at::Half*>(m_bytes)[g * LANES + i]) * xs[r * groups + g];
        } else if constexpr (k_min(LAYOUT)) {
          const at::Half* sd = d_half + g / 8 * 2 * LANES;
          const float dg = static_cast<float>(sd[i]) * static_cast<float>(m_bytes[g * 2 * LANES + i]);
          const float mg = -static_cast<float>(sd[LANES + i]) * static_cast<float>(m_bytes[g * 2 * LANES + LANES + i]);
          acc += dg * dxg * static_cast<float>(half[0] + half[1]);
          acc += mg * xs[r * groups + g];
        } else {
          const int8_t* sc = reinterpret_cast<const int8_t*>(m_bytes) + g * 2 * LANES;
          const int32_t* h = xh + (r * groups + g) * 2;
          const int32_t isum = sc[i] * (half[0] - 32 * h[0]) + sc[LANES + i] * (half[1] - 32 * h[1]);
          acc += static_cast<float>(d_half[g / 8 * LANES + i]) * dxg * static_cast<float>(isum);
        }
      }
      y[r * out + i] = res != nullptr ? acc + res[r * out + i] : acc;
    }
  }
#endif
}

#if defined(SPECPOOL_AVX512)
// ---------------------------------------------------------------------------------------------
// AMX (Intel's tile unit), where the CPU runs it and Python asked for it (set_amx_rows): a row tile's group of
// 32 inputs is one TDPBSUD (signed A x unsigned B, int32 C) for all its rows, where the vector path spends 8
// vpdpbusd a row. A is the rows' 32 bytes of xq (quantize_rows' layout, `in` bytes apart); B is the group's
// unpacked vectors w_0..w_7 as its 8 rows: AMX's B layout (K/4 rows of N times 4 bytes) is exactly one w_j a
// row. C's row r is then, lane for lane, the integer the vector path sums for row r (exact either way), and
// group_epilogue runs on it as there: a row's bits are those of the 1-row vector path. Q6K's two sub-blocks
// are two products of K = 16; Q6K and Q5 multiply centered, signed weights (TDPBSSD; amx_centered).
// Measured against the vector path (2048x1536, 1 thread): a tile product costs some 35 cycles a group whatever
// the rows, about 5 rows of vpdpbusd, while each row's float work (group_epilogue) stays the same; so AMX pays
// from 6 rows (12 for Q6K), by 0.86x at 9 rows of Q4_K in cache, and by less in a whole step, whose weights
// stream from memory (kernels.py, AMX_MIN_ROWS).

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes a row
  uint8_t rows[16] = {};
};

// This thread's tiles for `rows` rows of `layout` (TILELOADD/TDPBSUD read their shapes from here): C in tmm0-3
// (one a group in flight; Q6K's two halves of a group take two), A in tmm4-5 and B in tmm6-7, alternating.
void amx_configure(int64_t layout, int rows) {
  TileConfig cfg;
  const bool halves = layout == Q6K;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t < 6 ? rows : halves ? 4 : 8;  // B: w_j a row
    cfg.colsb[t] = t == 4 || t == 5 ? (halves ? GROUP / 2 : GROUP) : 4 * LANES;  // A: a row's bytes of the group
  }
  asm volatile("ldtilecfg %0" ::"m"(cfg));
}

void amx_release() { asm volatile("tilerelease" ::); }

std::atomic<int> amx_min_rows{0};  // row tiles of at least this many rows run on AMX; 0: none (set_amx_rows)
// Q6K's from this many rows only: two products a group (a fixed cost of some 35 cycles each, whatever the rows)
// against float work per row that is most of its vector path's time already. 2048x1536, 1 thread, AMX's time
// over the vector path's: 1.04 at 6 rows, 1.06 at 9, 0.94 at 12, 0.86 at 16.
constexpr int AMX_Q6K_ROWS = 12;
std::atomic<int64_t> amx_tiles_run{0};  // (block, row tile) products AMX ran: what a test checks

// One product C += A B into tile C from activations x (rows `in` bytes apart) and weights b (rows of 64 bytes),
// then C stored to c. The pointer comes back through the asm ("+r"), so that the loads of what was stored depend
// on the store and follow it; declaring the stored bytes an "=m" output instead kept every row's accumulator
// in memory (GCC 12), where the vector path keeps them in registers.
#define SPECPOOL_TILE_PRODUCT(DP, C, A, B, x, b, bytes, c)                                                  \
  do {                                                                                                      \
    asm volatile("tileloadd (%0,%1,1), %%tmm" #A ::"r"(x), "r"(in));                                       \
    asm volatile("tileloadd (%0,%1,1), %%tmm" #B ::"r"(b), "r"(int64_t{64}),                                \
                 "m"(*reinterpret_cast<const uint8_t(*)[bytes]>(b)));                                       \
    asm volatile("tilezero %%tmm" #C ::);                                                                   \
    asm volatile(DP " %%tmm" #B ", %%tmm" #A ", %%tmm" #C ::);                                              \
    asm volatile("tilestored %%tmm" #C ", (%0,%1,1)" : "+r"(c) : "r"(int64_t{64}));                         \
  } while (0)

// Group g's integer sums for every row, in flight slot SET, stored to c (and, Q6K, its second half to c1): x its
// activations, b its unpacked weights (Q8: packed).
template <int64_t LAYOUT, int SET>
inline void tile_group(const int8_t* x, int64_t in, const uint8_t* b, int32_t*& c, int32_t*& c1) {
  if constexpr (LAYOUT == Q6K) {
    if constexpr (SET == 0) {
      SPECPOOL_TILE_PRODUCT("tdpbssd", 0, 4, 6, x, b, 256, c);
      SPECPOOL_TILE_PRODUCT("tdpbssd", 1, 5, 7, x + GROUP / 2, b + 256, 256, c1);
    } else {
      SPECPOOL_TILE_PRODUCT("tdpbssd", 2, 4, 6, x, b, 256, c);
      SPECPOOL_TILE_PRODUCT("tdpbssd", 3, 5, 7, x + GROUP / 2, b + 256, 256, c1);
    }
  } else {
    // TDPBSUD: signed activations x unsigned weights; TDPBSSD: both signed (centered)
    if constexpr (SET == 0) {
      if constexpr (amx_centered(LAYOUT)) SPECPOOL_TILE_PRODUCT("tdpbssd", 0, 4, 6, x, b, 512, c);
      else SPECPOOL_TILE_PRODUCT("tdpbsud", 0, 4, 6, x, b, 512, c);
    } else if constexpr (SET == 1) {
      if constexpr (amx_centered(LAYOUT)) SPECPOOL_TILE_PRODUCT("tdpbssd", 1, 5, 7, x, b, 512, c);
      else SPECPOOL_TILE_PRODUCT("tdpbsud", 1, 5, 7, x, b, 512, c);
    } else if constexpr (SET == 2) {
      if constexpr (amx_centered(LAYOUT)) SPECPOOL_TILE_PRODUCT("tdpbssd", 2, 4, 6, x, b, 512, c);
      else SPECPOOL_TILE_PRODUCT("tdpbsud", 2, 4, 6, x, b, 512, c);
    } else {
      if constexpr (amx_centered(LAYOUT)) SPECPOOL_TILE_PRODUCT("tdpbssd", 3, 5, 7, x, b, 512, c);
      else SPECPOOL_TILE_PRODUCT("tdpbsud", 3, 5, 7, x, b, 512, c);
    }
  }
}
#undef SPECPOOL_TILE_PRODUCT

// block_rows for a row tile on AMX: the same outputs, bit for bit, with one tile product a group (two for Q6K).
template <int64_t LAYOUT, int TILE>
void block_rows_amx(const Block& blk, int64_t groups, const int8_t* xq, const float* dx, const float* xs,
                    const int32_t* xh, int64_t in, const float* res, float* y, int64_t out) {
  constexpr int BYTES = group_bytes(LAYOUT);
  // Products run DEPTH groups ahead of the float work that reads their sums (a product's result takes some 70
  // cycles to reach a vector load), on as many C tiles as that keeps in flight (Q6K's take two each).
  constexpr int DEPTH = LAYOUT == Q6K ? 1 : 3, SETS = DEPTH + 1;
  // Unpacked B, further ahead still: a tile load of bytes that vector stores have just written waits for those
  // stores to leave the core (at 1 row 4x the vector path's time, measured), while stores made groups earlier
  // have long landed in L1.
  constexpr int AHEAD = DEPTH + 4, RING = AHEAD + 1;
  alignas(64) uint8_t wbuf[RING][8 * 4 * LANES];
  alignas(64) int32_t sums[SETS][2][TILE * LANES];  // C as stored, per slot (and Q6K's half)
  const auto unpack = [&blk, &wbuf](int64_t g) {
    if constexpr (LAYOUT != Q8) {  // Q8's B is its packed bytes as they are
      __m512i w[8];
      unpack_group<LAYOUT>(blk.qs + g * BYTES, w);
      const __m512i center = _mm512_set1_epi8(LAYOUT == Q6K ? 32 : 16);
      for (int j = 0; j < 8; ++j)
        _mm512_store_si512(wbuf[g % RING] + 64 * j, amx_centered(LAYOUT) ? _mm512_sub_epi8(w[j], center) : w[j]);
    }
  };
  int32_t* c[SETS][2];
  for (int t = 0; t < SETS; ++t) c[t][0] = sums[t][0], c[t][1] = sums[t][1];
  const auto product = [&](int64_t g) {
    const int8_t* x = xq + g * GROUP;
    const uint8_t* b = LAYOUT == Q8 ? blk.qs + g * BYTES : wbuf[g % RING];
    int32_t*(&cs)[2] = c[g % SETS];
    switch (g % SETS) {
      case 0: tile_group<LAYOUT, 0>(x, in, b, cs[0], cs[1]); break;
      case 1: tile_group<LAYOUT, 1>(x, in, b, cs[0], cs[1]); break;
      case 2: tile_group<LAYOUT, 2>(x, in, b, cs[0], cs[1]); break;
      default: tile_group<LAYOUT, 3>(x, in, b, cs[0], cs[1]); break;
    }
  };
  __m512 acc[TILE];
  for (int r = 0; r < TILE; ++r) acc[r] = _mm512_setzero_ps();
  __m512 super[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t g = 0; g < std::min<int64_t>(AHEAD, groups); ++g) unpack(g);
  for (int64_t g = 0; g < std::min<int64_t>(DEPTH, groups); ++g) product(g);
  for (int64_t g = 0; g < groups; ++g) {
    prefetch_group<LAYOUT>(blk.qs, g + PREFETCH_GROUPS);
    if (g + DEPTH < groups) product(g + DEPTH);  // runs while this group's sums are read
    if (g + AHEAD < groups) unpack(g + AHEAD);
    const Scales s = group_scales<LAYOUT>(blk, g, super);
    const int32_t* c0 = c[g % SETS][0];
    const int32_t* c1 = c[g % SETS][1];
#pragma GCC unroll 16
    for (int r = 0; r < TILE; ++r) {
      const __m512i dot = _mm512_load_si512(c0 + r * LANES);
      const __m512i dot1 = LAYOUT == Q6K ? _mm512_load_si512(c1 + r * LANES) : dot;
      acc[r] = group_epilogue<LAYOUT, amx_centered(LAYOUT)>(acc[r], dot, dot1, s, dx, xs, xh, groups, r, g);
    }
  }
  for (int r = 0; r < TILE; ++r)
    _mm512_storeu_ps(y + r * out, res != nullptr ? _mm512_add_ps(acc[r], _mm512_loadu_ps(res + r * out)) : acc[r]);
}

// The AMX instantiation for a tile of `tile` rows (1 .. ROW_TILE_MAX), from a table made at compile time.
template <int64_t LAYOUT, std::size_t... T>
constexpr auto amx_rows_table(std::index_sequence<T...>) {
  return std::array{&block_rows_amx<LAYOUT, static_cast<int>(T) + 1>...};
}

template <int64_t LAYOUT>
auto amx_rows_fn(int tile) -> decltype(&block_rows_amx<LAYOUT, 1>) {
  static constexpr auto table = amx_rows_table<LAYOUT>(std::make_index_sequence<ROW_TILE_MAX>());
  return table[std::clamp(tile, 1, ROW_TILE_MAX) - 1];
}

// Row tiles of at least `rows` rows on AMX from now on (0: none); asks Linux for the tile state first. Python
// calls it only where cpu_features has seen AMX execute: VMs have advertised it and faulted. -> whether on.
bool set_amx_rows(int64_t rows) {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  amx_min_rows = rows > 0 && permitted ? static_cast<int>(std::min<int64_t>(rows, ROW_TILE_MAX)) : 0;
  return amx_min_rows > 0;
}
#else
bool set_amx_rows(int64_t) { return false; }  // AMX is an AVX-512 build's
#endif

// The instantiation for a tile of `tile` rows (1 .. ROW_TILE_MAX), from a table made at compile time.
template <int64_t LAYOUT, std::size_t... T>
constexpr auto rows_table(std::index_sequence<T...>) {
  return std::array{&block_rows<LAYOUT, static_cast<int>(T) + 1>...};
}

template <int64_t LAYOUT>
auto rows_fn(int tile) -> decltype(&block_rows<LAYOUT, 1>) {
  static constexpr auto table = rows_table<LAYOUT>(std::make_index_sequence<ROW_TILE_MAX>());
  return table[std::clamp(tile, 1, ROW_TILE_MAX) - 1];
}

// y [rows, out] = x [rows, in] @ W.T, W repacked as above in `layout`: qs [out / LANES, groups, group_bytes],
// d and m as the layout says (m empty for Q8 and Q5).
at::Tensor block_linear(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& d, const at::Tensor& m,
                        int64_t layout, const std::optional<at::Tensor>& norm, double eps, bool silu_mul,
                        const std::optional<at::Tensor>& residual) {
  TORCH_CHECK(layout == Q4 || layout == Q5 || layout == Q8 || layout == Q4K || layout == Q5K || layout == Q6K,
              "block_linear: layout 4, 5, 8, 41, 51 or 61");
  TORCH_CHECK(x.scalar_type() == at::kFloat && qs.scalar_type() == at::kByte && d.scalar_type() == at::kHalf,
              "block_linear: x fp32, qs uint8, d fp16");
  TORCH_CHECK(qs.dim() == 3 && qs.size(2) == group_bytes(layout) && qs.is_contiguous() && d.is_contiguous() &&
              m.is_contiguous(), "block_linear: qs [out / lanes, groups, bytes] as block_layout() says, contiguous");
  const int64_t blocks = qs.size(0), groups = qs.size(1), in = groups * GROUP, out = blocks * LANES;
  const bool super = k_quant(layout), no_m = layout == Q8 || layout == Q5, sums = layout == Q5 || layout == Q6K;
  if (super) {
    TORCH_CHECK(groups % 8 == 0, "block_linear: K-quant inputs a multiple of 256");
    TORCH_CHECK(d.numel() == blocks * groups / 8 * (k_min(layout) ? 2 : 1) * LANES,
                "block_linear: d [out / lanes, groups / 8, (2,) lanes]");
    TORCH_CHECK(m.numel() == blocks * groups * 2 * LANES &&
                m.scalar_type() == (k_min(layout) ? at::kByte : at::kChar), "block_linear: m [out / lanes, groups, 2, lanes] "
                "uint8 (Q4_K, Q5_K) or int8 (Q6_K)");
  } else {
    TORCH_CHECK(d.numel() == blocks * groups * LANES && (no_m || (m.sizes() == d.sizes() &&
                m.scalar_type() == at::kHalf)), "block_linear: d and m [out / lanes, groups, lanes] fp16");
  }
  const int64_t width = silu_mul ? 2 * in : in;
  TORCH_CHECK(x.size(-1) == width, "block_linear: x has ", x.size(-1), " inputs, the weights ", in,
              silu_mul ? " (twice that with silu_mul: gate, up)" : "");
  TORCH_CHECK(!(silu_mul && norm.has_value()), "block_linear: norm or silu_mul, not both");
  const at::Tensor rows2d = x.reshape({-1, width}).contiguous();
  const int64_t rows = rows2d.size(0);
  auto xq = at::empty({rows, in}, x.options().dtype(at::kChar));
  auto dx = at::empty({rows, groups}, x.options());
  auto xs = at::empty({rows, groups}, x.options());
  auto xh = at::empty({sums ? rows : 0, groups, 2}, x.options().dtype(at::kInt));
  if (norm.has_value())
    TORCH_CHECK(norm->scalar_type() == at::kFloat && norm->numel() == in && norm->is_contiguous(),
                "block_linear: norm [in] fp32");
  TORCH_CHECK(in % 8 == 0, "block_linear: inputs a multiple of 8");
  quantize_rows(rows2d.data_ptr<float>(), rows, in, norm.has_value() ? norm->data_ptr<float>() : nullptr,
                static_cast<float>(eps), silu_mul, xq.data_ptr<int8_t>(), dx.data_ptr<float>(), xs.data_ptr<float>(),
                sums ? xh.data_ptr<int32_t>() : nullptr);
  auto y = at::empty({rows, out}, x.options());
  at::Tensor res;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->numel() == rows * out,
                "block_linear: residual [rows, out] fp32");
    res = residual->reshape({rows, out}).contiguous();
  }
  const float* res_ptr = residual.has_value() ? res.data_ptr<float>() : nullptr;
  const uint8_t* q_ptr = qs.data_ptr<uint8_t>();
  const at::Half* d_ptr = d.data_ptr<at::Half>();
  const uint8_t* m_ptr = no_m ? nullptr : static_cast<const uint8_t*>(m.data_ptr());
  const int8_t* xq_ptr = xq.data_ptr<int8_t>();
  const float* dx_ptr = dx.data_ptr<float>();
  const float* xs_ptr = xs.data_ptr<float>();
  const int32_t* xh_ptr = sums ? xh.data_ptr<int32_t>() : nullptr;
  float* y_ptr = y.data_ptr<float>();
  const auto rows_of = [layout](int tile) {
    switch (layout) {
      case Q4: return rows_fn<Q4>(tile);
      case Q5: return rows_fn<Q5>(tile);
      case Q8: return rows_fn<Q8>(tile);
      case Q4K: return rows_fn<Q4K>(tile);
      case Q5K: return rows_fn<Q5K>(tile);
      default: return rows_fn<Q6K>(tile);
    }
  };
  // Per block of outputs: bytes of weights, of d (fp16 elements) and of m.
  const int64_t block_bytes = groups * qs.size(2);
  const int64_t block_d = d.numel() / blocks, block_m = no_m ? 0 : m.numel() * m.element_size() / blocks;
#if defined(SPECPOOL_AVX512)
  const int amx_rows = amx_min_rows.load();
  const auto amx_rows_of = [layout](int tile) {
    switch (layout) {
      case Q4: return amx_rows_fn<Q4>(tile);
      case Q5: return amx_rows_fn<Q5>(tile);
      case Q8: return amx_rows_fn<Q8>(tile);
      case Q4K: return amx_rows_fn<Q4K>(tile);
      case Q5K: return amx_rows_fn<Q5K>(tile);
      default: return amx_rows_fn<Q6K>(tile);
    }
  };
#endif
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
#if defined(SPECPOOL_AVX512)
    int configured = 0;  // the rows this thread's tiles are configured for (0: not configured)
    int64_t on_amx = 0;
#endif
    for (int64_t ob = begin; ob < end; ++ob) {
      const Block blk{q_ptr + ob * block_bytes, d_ptr + ob * block_d, m_ptr ? m_ptr + ob * block_m : nullptr};
      for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
        const int tile = static_cast<int>(std::min<int64_t>(ROW_TILE, rows - r0));
        auto fn = rows_of(tile);
#if defined(SPECPOOL_AVX512)
        if (amx_rows > 0 && tile >= std::max(amx_rows, layout == Q6K ? AMX_Q6K_ROWS : 0)) {
          if (configured != tile) amx_configure(layout, configured = tile);
          fn = amx_rows_of(tile);
          ++on_amx;
        }
#endif
        fn(blk, groups, xq_ptr + r0 * in, dx_ptr + r0 * groups, xs_ptr + r0 * groups,
           xh_ptr ? xh_ptr + r0 * groups * 2 : nullptr, in, res_ptr ? res_ptr + r0 * out + ob * LANES : nullptr,
           y_ptr + r0 * out + ob * LANES, out);
      }
    }
#if defined(SPECPOOL_AVX512)
    if (configured) {
      amx_release();
      amx_tiles_run += on_amx;
    }
#endif
  });
  auto shape = x.sizes().vec();
  shape.back() = out;
  return y.view(shape);
}


// ---------------------------------------------------------------------------------------------
// Attention of queries q [N, H, D] over the cache of one layer, k and v [S, Hkv, L, D] (fp32). Query n
// sees, in this order, the keys at positions 0 .. prefix[n]-1 of slot slot[n], then the positions
// extra[n, :] that are >= 0 (a token tree's ancestors, itself last). Scores, softmax and the weighted
// sum run over exactly those keys in exactly that order, so a query's output does not depend on which
// other queries, rows or padding share the call.

// Eight floats as one value (GCC's vector extension): the same operations on every lane, in every build.
typedef float f8 __attribute__((vector_size(32)));
typedef float f8_unaligned __attribute__((vector_size(32), aligned(4)));  // loads from any float

// e^x for scores minus their maximum (x <= 0), eight at a time: Cephes' expf (within 2 ulp of std::exp)
// in operations each lane runs alike, so a score's weight is the same bits wherever it sits in the vector.
inline f8 exp8(f8 x) {
  const f8 lowest = f8{} - 87.f;  // e^-87 ~ 1.6e-38, still a normal float: below it a weight is nothing
  x = x < lowest ? lowest : x;
  const f8 shift = f8{} + 12582912.f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const f8 n = (x * 1.44269504088896341f + shift) - shift;  // round(x / ln 2)
  const f8 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // x - n ln 2, ln 2 in two parts
  f8 p = f8{} + 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const f8 y = p * (r * r) + r + 1.f;
  typedef int32_t i8 __attribute__((vector_size(32)));
  const i8 scale = (__builtin_convertvector(n, i8) + 127) << 23;  // 2^n as a float's bits (n >= -126)
  f8 two_n;
  std::memcpy(&two_n, &scale, sizeof two_n);
  return y * two_n;
}

at::Tensor visible_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& slot,
                             const at::Tensor& prefix, const at::Tensor& extra) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "visible_attention: fp32 q, k, v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes(), "visible_attention: q [N, H, D], k/v [S, Hkv, L, D]");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), L = k.size(2);
  TORCH_CHECK(k.size(3) == D && H % Hkv == 0 && D % 8 == 0, "visible_attention: head shapes (D a multiple of 8)");
  TORCH_CHECK(slot.numel() == N && prefix.numel() == N && extra.dim() == 2 && extra.size(0) == N,
              "visible_attention: slot, prefix [N], extra [N, E]");
  const at::Tensor qc = q.contiguous();
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "visible_attention: k and v contiguous in D");
  const auto slots = slot.to(at::kLong).contiguous(), prefixes = prefix.to(at::kLong).contiguous();
  const auto extras = extra.to(at::kLong).contiguous();
  const int64_t E = extras.size(1), S = k.size(0);
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t* prefix_p = prefixes.data_ptr<int64_t>();
  const int64_t* extra_p = extras.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(slot_p[n] >= 0 && slot_p[n] < S && prefix_p[n] >= 0 && prefix_p[n] <= L,
                "visible_attention: query ", n, " slot or prefix out of range");
    for (int64_t e = 0; e < E; ++e)
      TORCH_CHECK(extra_p[n * E + e] < L, "visible_attention: query ", n, " extra position out of range");
  }
  auto out = at::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), ks2 = k.stride(2);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const int64_t group = H / Hkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  // A task is one query's heads that share a key-value head (all of them where there are tasks enough to
  // keep every thread busy; else one, as in a decode step's few queries), so each key and value row is read
  // once for all its heads. A head's arithmetic is the same either way.
  const int64_t heads = N * Hkv >= 2 * at::get_num_threads() ? group : 1, tasks = H / heads;
  at::parallel_for(0, N * tasks, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> keys;
    std::vector<float> p, acc, mx(heads), total(heads);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / tasks, h0 = task % tasks * heads, kvh = h0 / group;
      keys.clear();
      for (int64_t j = 0; j < prefix_p[n]; ++j) keys.push_back(j);
      for (int64_t e = 0; e < E; ++e)
        if (extra_p[n * E + e] >= 0) keys.push_back(extra_p[n * E + e]);
      const float* q0 = qp + (n * H + h0) * D;
      float* o0 = op + (n * H + h0) * D;
      if (keys.empty()) {
        std::fill(o0, o0 + heads * D, 0.f);
        continue;
      }
      const size_t count = keys.size(), padded = (count + 7) / 8 * 8;
      p.resize(heads * padded);
      std::fill(mx.begin(), mx.end(), -INFINITY);
      for (size_t j = 0; j < count; ++j) {
        const auto* kv = reinterpret_cast<const f8_unaligned*>(kp + slot_p[n] * ks0 + kvh * ks1 + keys[j] * ks2);
        for (int64_t h = 0; h < heads; ++h) {
          const auto* q8 = reinterpret_cast<const f8_unaligned*>(q0 + h * D);
          f8 lanes = q8[0] * kv[0];  // a fixed lane structure: the same sum for every key and call
          for (int64_t c = 1; c < D / 8; ++c) lanes += q8[c] * kv[c];
          const float s = (((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                           ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]))) * scale;
          p[h * padded + j] = s;
          mx[h] = std::fmax(mx[h], s);
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* ph = p.data() + h * padded;
        std::fill(ph + count, ph + padded, mx[h]);
        for (size_t j = 0; j < padded; j += 8) {
          f8 e;
          std::memcpy(&e, ph + j, sizeof e);
          e = exp8(e - mx[h]);
          std::memcpy(ph + j, &e, sizeof e);
        }
      }
      acc.assign(heads * D, 0.f);
      std::fill(total.begin(), total.end(), 0.f);
      for (size_t j = 0; j < count; ++j) {
        const float* vv = vp + slot_p[n] * vs0 + kvh * vs1 + keys[j] * vs2;
        for (int64_t h = 0; h < heads; ++h) {
          const float e = p[h * padded + j];
          total[h] += e;
          float* a = acc.data() + h * D;
          for (int64_t c = 0; c < D; ++c) a[c] += e * vv[c];
        }
      }
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t c = 0; c < D; ++c) o0[h * D + c] = acc[h * D + c] * (1.f / total[h]);
    }
  });
  return out;
}

// One layer's attention for a decode or verify step, from the fused q/k/v product qkv [N, (H + 2 Hkv) * D]:
// RoPE on q and k (adjacent pairs (2i, 2i+1) rotated by cos, sin [N, D / 2]: llama.cpp's GGUF layout), the
// new keys and values written at (write_slot[n], write_pos[n]) of the layer's cache k, v, then
// `visible_attention`: one call a layer. -> [N, H * D]
at::Tensor cache_attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k,
                           at::Tensor& v, const at::Tensor& write_slot, const at::Tensor& write_pos,
                           const at::Tensor& slot, const at::Tensor& prefix, const at::Tensor& extra) {
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.sizes() == k.sizes() && k.dim() == 4, "cache_attention: k, v [S, Hkv, L, D] fp32");
  const int64_t S = k.size(0), Hkv = k.size(1), L = k.size(2), D = k.size(3), half = D / 2;
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.size(1) % D == 0 && qkv.size(1) / D > 2 * Hkv,
              "cache_attention: qkv [N, (H + 2 Hkv) * D] fp32");
  const int64_t N = qkv.size(0), H = qkv.size(1) / D - 2 * Hkv;
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == N && cos.size(-1) == half && cos.scalar_type() == at::kFloat,
              "cache_attention: cos, sin [N, D / 2] fp32");
  TORCH_CHECK(write_slot.numel() == N && write_pos.numel() == N, "cache_attention: write_slot, write_pos [N]");
  const auto in = qkv.contiguous(), c = cos.contiguous(), sn = sin.contiguous();
  const auto ws = write_slot.to(at::kLong).contiguous(), wp = write_pos.to(at::kLong).contiguous();
  auto q = at::empty({N, H, D}, qkv.options());
  const float* src = in.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s = ws.data_ptr<int64_t>()[n], p = wp.data_ptr<int64_t>()[n];
    TORCH_CHECK(s >= 0 && s < S && p >= 0 && p < L, "cache_attention: row ", n, " writes outside the cache");
    const float* cn = c.data_ptr<float>() + n * half;
    const float* sn_ = sn.data_ptr<float>() + n * half;
    const float* row = src + n * (H + 2 * Hkv) * D;
    for (int64_t h = 0; h < H + Hkv; ++h) {  // q heads, then k heads: rotated
      float* dst = h < H ? qp + (n * H + h) * D : k.data_ptr<float>() + s * k.stride(0) + (h - H) * k.stride(1) + p * k.stride(2);
      const float* x = row + h * D;
      for (int64_t i = 0; i < half; ++i) {
        const float x0 = x[2 * i], x1 = x[2 * i + 1];
        dst[2 * i] = x0 * cn[i] - x1 * sn_[i];
        dst[2 * i + 1] = x0 * sn_[i] + x1 * cn[i];
      }
    }
    for (int64_t h = 0; h < Hkv; ++h)  // v heads: as they are
      std::memcpy(v.data_ptr<float>() + s * v.stride(0) + h * v.stride(1) + p * v.stride(2),
                  row + (H + Hkv + h) * D, D * sizeof(float));
  }
  return visible_attention(q, k, v, slot, prefix, extra).view({N, H * D});
}

// What BlockLinear packs for this build: (lanes, whether 8-bit weights are stored offset by 128).
std::tuple<int64_t, bool> block_layout() { return {LANES, SIGNED_OFFSET}; }

// How many (block, row tile) products have run on AMX in this process: a test's proof that they did.
int64_t amx_tiles() {
#if defined(SPECPOOL_AVX512)
  return amx_tiles_run.load();
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY(specpool, lib) {
  lib.def("block_linear(Tensor x, Tensor qs, Tensor d, Tensor m, int layout, Tensor? norm=None, float eps=0, "
          "bool silu_mul=False, Tensor? residual=None) -> Tensor");
  lib.def("block_layout() -> (int, bool)", &block_layout);  // no tensor to dispatch on: one impl for all
  lib.def("set_amx_rows(int rows) -> bool", &set_amx_rows);
  lib.def("amx_tiles() -> int", &amx_tiles);
  lib.def("visible_attention(Tensor q, Tensor k, Tensor v, Tensor slot, Tensor prefix, Tensor extra) -> Tensor");
  lib.def("cache_attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k, Tensor(b!) v, Tensor write_slot, "
          "Tensor write_pos, Tensor slot, Tensor prefix, Tensor extra) -> Tensor");
}

TORCH_LIBRARY_IMPL(specpool, CPU, lib) {
  lib.impl("block_linear", &block_linear);
  lib.impl("visible_attention", &visible_attention);
  lib.impl("cache_attention", &cache_attention);
}
