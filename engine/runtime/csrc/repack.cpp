// Weights repacked at load from the GGUF's block formats into the layouts cpu_kernels.cpp reads (its header
// comment: one output a 32-bit lane, LANES outputs a block). One pass over the file's bytes straight into the
// packed tensors: the repacking in numpy and torch it replaces took 5.4 s of a 1.5B Q4_K_M file's load, and
// its temporaries several times each matrix.
//
// Each block of LANES outputs is unpacked first, row by row, into q values (one byte a weight) and the
// block's scales, then written in the layout; the last block's rows past `out` are padding: zero scales,
// and the q a zero weight has in the fields of engine/runtime/gguf_loader.py (QuantizedBlocks.fields).
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

// ggml's type ids (gguf.GGMLQuantizationType) and the kernel's layouts (cpu_kernels.cpp `Layout`).
enum Kind : int64_t { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
enum Layout : int64_t { Q4 = 4, Q5 = 5, Q8 = 8, Q4K = 41, Q5K = 51, Q6K = 61 };
constexpr int GROUP = 32, SUPER = 256;

struct Format {
  int64_t layout;
  int block_bytes, block_weights;  // the file's: bytes of one block, weights it holds
  int group_bytes;                 // the layout's bytes of one group for one lane
};

Format format_of(int64_t kind) {
  switch (kind) {
    case Q4_0: return {Q4, 18, GROUP, 16};
    case Q4_1: return {Q4, 20, GROUP, 16};
    case Q5_0: return {Q5, 22, GROUP, 20};
    case Q8_0: return {Q8, 34, GROUP, 32};
    case Q4_K: return {Q4K, 144, SUPER, 16};
    case Q5_K: return {Q5K, 176, SUPER, 20};
    case Q6_K: return {Q6K, 210, SUPER, 24};
  }
  TORCH_CHECK(false, "repack_blocks: no kernel layout for ggml type ", kind);
}

inline uint16_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// Q4_K's and Q5_K's 6-bit scale and min of group j from the super-block's 12 bytes (ggml's get_scale_min_k4).
inline void scale_min(const uint8_t* s, int j, uint8_t& sc, uint8_t& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// One row of the file: its q values (the weight's code as the layout stores it), and its scales per group (Q4,
// Q5, Q8: d and m fp16 bits; Q4K/Q5K: d, dmin per super-block and sc, mn per group; Q6K: d per super-block and
// the int8 scale per 16 weights).
struct Row {
  std::vector<uint8_t> q;
  std::vector<uint16_t> d, m;      // fp16 bits: per group (Q4, Q5, Q8), or per super-block (K-quants: m is dmin)
  std::vector<uint8_t> sc, mn;     // K-quants: per group (Q6_K: two int8 scales a group, in sc)
};

void read_row(const uint8_t* src, int64_t kind, int64_t in, bool offset_8bit, Row& row) {
  const Format f = format_of(kind);
  const int64_t n = in / f.block_weights;
  uint8_t* q = row.q.data();
  for (int64_t b = 0; b < n; ++b, src += f.block_bytes, q += f.block_weights) {
    switch (kind) {
      case Q4_0:
      case Q4_1:
      case Q5_0: {
        const uint16_t d = u16(src);
        const uint8_t* nib = src + (kind == Q4_0 ? 2 : kind == Q4_1 ? 4 : 6);
        uint32_t high = 0;
        if (kind == Q5_0) std::memcpy(&high, src + 2, 4);
        for (int j = 0; j < 16; ++j) {
          q[j] = (nib[j] & 0x0F) | (kind == Q5_0 ? ((high >> j) & 1) << 4 : 0);
          q[j + 16] = (nib[j] >> 4) | (kind == Q5_0 ? ((high >> (j + 16)) & 1) << 4 : 0);
        }
        row.d[b] = d;
        // Q4_0's d * (q - 8) as d * q + m, m = -8 d: exact in fp16 (an exponent step) unless it overflows.
        if (kind == Q4_0) {
          const float m = -8.0f * float(c10::Half(d, c10::Half::from_bits()));
          TORCH_CHECK(std::abs(m) <= 65504.0f, "repack_blocks: a Q4_0 scale whose -8 d fp16 does not hold");
          row.m[b] = c10::Half(m).x;
        }
        if (kind == Q4_1) row.m[b] = u16(src + 2);
        break;
      }
      case Q8_0:
        row.d[b] = u16(src);
        for (int j = 0; j < GROUP; ++j) q[j] = uint8_t(int(int8_t(src[2 + j])) + (offset_8bit ? 128 : 0));
        break;
      case Q4_K:
      case Q5_K: {
        row.d[b] = u16(src);  // and dmin, as m
        row.m[b] = u16(src + 2);
        for (int g = 0; g < 8; ++g) scale_min(src + 4, g, row.sc[8 * b + g], row.mn[8 * b + g]);
        const uint8_t* nib = src + (kind == Q4_K ? 16 : 48);
        for (int c = 0; c < 4; ++c)  // groups 2c and 2c + 1: the low and high nibbles of 32 bytes
          for (int k = 0; k < GROUP; ++k) {
            q[64 * c + k] = nib[32 * c + k] & 0x0F;
            q[64 * c + 32 + k] = nib[32 * c + k] >> 4;
          }
        if (kind == Q5_K)  // bit g of byte k: the fifth bit of group g's element k
          for (int g = 0; g < 8; ++g)
            for (int k = 0; k < GROUP; ++k) q[32 * g + k] |= ((src[16 + k] >> g) & 1) << 4;
        break;
      }
      case Q6_K: {  // ggml's dequantize_row_q6_K: two halves of 128, each from 64 bytes of ql and 32 of qh
        const uint8_t *ql = src, *qh = src + 128;
        for (int h = 0; h < 2; ++h)
          for (int k = 0; k < 32; ++k) {
            uint8_t* o = q + 128 * h;
            const uint8_t* l = ql + 64 * h;
            const uint8_t hb = qh[32 * h + k];
            o[k] = (l[k] & 0x0F) | ((hb & 3) << 4);
            o[k + 32] = (l[k + 32] & 0x0F) | (((hb >> 2) & 3) << 4);
            o[k + 64] = (l[k] >> 4) | (((hb >> 4) & 3) << 4);
            o[k + 96] = (l[k + 32] >> 4) | (((hb >> 6) & 3) << 4);
          }
        std::memcpy(row.sc.data() + 16 * b, src + 192, 16);
        row.d[b] = u16(src + 208);
        break;
      }
    }
  }
}

// The padding rows' fields: a zero weight (QuantizedBlocks.fields padded with zeros, as BlockLinear had it).
void zero_row(int64_t kind, bool offset_8bit, Row& row) {
  std::fill(row.q.begin(), row.q.end(), kind == Q5_0 ? 16 : kind == Q8_0 && offset_8bit ? 128 : 0);
  std::fill(row.d.begin(), row.d.end(), 0);
  std::fill(row.m.begin(), row.m.end(), 0);
  std::fill(row.sc.begin(), row.sc.end(), 0);
  std::fill(row.mn.begin(), row.mn.end(), 0);
}

// raw [out, in / block weights * block bytes] uint8, the file's rows -> (qs, d, m) as BlockLinear holds them.
std::tuple<at::Tensor, at::Tensor, at::Tensor> repack_blocks(const at::Tensor& raw, int64_t kind, int64_t in,
                                                            int64_t lanes, bool offset_8bit) {
  const Format f = format_of(kind);
  TORCH_CHECK(raw.scalar_type() == at::kByte && raw.dim() == 2 && raw.is_contiguous(),
              "repack_blocks: raw uint8 [out, row bytes], contiguous");
  TORCH_CHECK(in > 0 && in % f.block_weights == 0 && raw.size(1) == in / f.block_weights * f.block_bytes,
              "repack_blocks: rows of ", in, " weights are ", in / f.block_weights * f.block_bytes, " bytes, not ",
              raw.size(1));
  TORCH_CHECK(lanes == 8 || lanes == 16, "repack_blocks: 8 or 16 lanes");
  const int64_t out = raw.size(0), blocks = (out + lanes - 1) / lanes, groups = in / GROUP, supers = in / SUPER;
  const bool k_min = f.layout == Q4K || f.layout == Q5K, q6k = f.layout == Q6K;
  auto u8 = raw.options(), half = raw.options().dtype(at::kHalf);
  at::Tensor qs = at::empty({blocks, groups, f.group_bytes * lanes}, u8);
  at::Tensor d = k_min ? at::empty({blocks, supers, 2, lanes}, half)
                 : q6k ? at::empty({blocks, supers, lanes}, half) : at::empty({blocks, groups, lanes}, half);
  at::Tensor m = k_min ? at::empty({blocks, groups, 2, lanes}, u8)
                 : q6k ? at::empty({blocks, groups, 2, lanes}, u8.dtype(at::kChar))
                 : f.layout == Q4 ? at::empty({blocks, groups, lanes}, half) : at::empty({0}, half);
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* qs_p = qs.data_ptr<uint8_t>();
  uint16_t* d_p = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  uint8_t* m_p = static_cast<uint8_t*>(m.data_ptr());
  uint16_t* m16 = reinterpret_cast<uint16_t*>(m_p);
  const int64_t row_bytes = raw.size(1), gb = f.group_bytes * lanes;

  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<Row> rows(lanes);
    for (auto& r : rows) {
      r.q.resize(in);
      r.d.resize(k_min || q6k ? supers : groups);
      r.m.resize(k_min ? supers : groups);
      r.sc.resize(q6k ? 2 * groups : groups);
      r.mn.resize(groups);
    }
    for (int64_t ob = begin; ob < end; ++ob) {
      for (int64_t i = 0; i < lanes; ++i) {
        const int64_t o = ob * lanes + i;
        if (o < out) read_row(src + o * row_bytes, kind, in, offset_8bit, rows[i]);
        else zero_row(kind, offset_8bit, rows[i]);
      }
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* dst = qs_p + (ob * groups + g) * gb;
        for (int64_t i = 0; i < lanes; ++i) {
          const uint8_t* q = rows[i].q.data() + g * GROUP;
          if (f.layout == Q8) {  // vector j, lane i: elements 4j..4j+3
            for (int j = 0; j < 8; ++j) std::memcpy(dst + (j * lanes + i) * 4, q + 4 * j, 4);
            continue;
          }
          for (int L = 0; L < 4; ++L)  // vector L, lane i, byte b: elements 8L + b (low), 8L + 4 + b (high)
            for (int b = 0; b < 4; ++b)
              dst[(L * lanes + i) * 4 + b] = (q[8 * L + b] & 0x0F) | ((q[8 * L + 4 + b] & 0x0F) << 4);
          uint8_t* extra = dst + 16 * lanes;
          if (f.layout == Q5 || f.layout == Q5K) {  // lane i's byte b: bit j the fifth of element 4j + b
            for (int b = 0; b < 4; ++b) {
              uint8_t word = 0;
              for (int j = 0; j < 8; ++j) word |= ((q[4 * j + b] >> 4) & 1) << j;
              extra[i * 4 + b] = word;
            }
          } else if (q6k) {  // vector h, lane i, byte b: bits 2t..2t+1 the high two of element 16h + 4t + b
            for (int h = 0; h < 2; ++h)
              for (int b = 0; b < 4; ++b) {
                uint8_t v = 0;
                for (int t = 0; t < 4; ++t) v |= ((q[16 * h + 4 * t + b] >> 4) & 3) << (2 * t);
                extra[(h * lanes + i) * 4 + b] = v;
              }
          }
        }
      }
      for (int64_t i = 0; i < lanes; ++i) {  // the scales, one output a lane
        const Row& r = rows[i];
        if (k_min) {
          for (int64_t s = 0; s < supers; ++s)
            for (int k = 0; k < 2; ++k) d_p[((ob * supers + s) * 2 + k) * lanes + i] = k ? r.m[s] : r.d[s];
          for (int64_t g = 0; g < groups; ++g) {
            m_p[((ob * groups + g) * 2 + 0) * lanes + i] = r.sc[g];
            m_p[((ob * groups + g) * 2 + 1) * lanes + i] = r.mn[g];
          }
        } else if (q6k) {
          for (int64_t s = 0; s < supers; ++s) d_p[(ob * supers + s) * lanes + i] = r.d[s];
          for (int64_t g = 0; g < groups; ++g)
            for (int k = 0; k < 2; ++k) m_p[((ob * groups + g) * 2 + k) * lanes + i] = r.sc[2 * g + k];
        } else {
          for (int64_t g = 0; g < groups; ++g) {
            d_p[(ob * groups + g) * lanes + i] = r.d[g];
            if (f.layout == Q4) m16[(ob * groups + g) * lanes + i] = r.m[g];
          }
        }
      }
    }
  });
  return {qs, d, m};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specpool, lib) {
  lib.def("repack_blocks(Tensor raw, int kind, int inputs, int lanes, bool offset_8bit) -> (Tensor, Tensor, Tensor)",
          &repack_blocks);
}
