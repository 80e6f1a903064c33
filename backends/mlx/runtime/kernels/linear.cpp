#include "linear.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <numeric>
#include <stdexcept>
#include <string>

#include "blas.h"
#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "float_gemm.h"
#include "norm.h"
#include "packed_floats.h"
#include "quantized_dot.h"
#include "thread_pool.h"
#include "upcoming_weights.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));  // (only inside AVX-512 functions)
typedef uint32_t u32x8 __attribute__((vector_size(32)));
typedef uint16_t u16x8 __attribute__((vector_size(16)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint64_t u64x4 __attribute__((vector_size(32)));

// How the weight matrix [N, K] is stored (Packed: float32 packed at load, packed_floats.h).
enum class Format : int { F32, BF16, Q4, Q8, Packed };

// Bits a stored weight takes in `format` (not Packed: see weight_bytes).
constexpr int format_bits(Format format) {
  return format == Format::F32 ? 32 : format == Format::BF16 ? 16 : format == Format::Q8 ? 8 : 4;
}

// A linear layer's weights as our kernel reads them: their format, and for
// the quantized ones the group, how x meets them, and whether they are
// tiled (quantized_dot.h).
struct Spec {
  Format format;
  int group = 0;
  Activations activations = Activations::Float;
  bool tiled = false;
};

struct Operands {
  Format format;
  int group;             // quantized: K values per (scale, bias) pair
  const float* x;        // [M, K], float32 (converted up front when bf16)
  const void* w;         // F32/BF16: [N, K]; Q4/Q8: [N, K * bits / 32] packed uint32; Packed: packed.rows
  PackedView packed;     // Packed: the matrix
  const void* scales;    // quantized: [N, K / group]
  const void* biases;    // quantized: [N, K / group]
  bool params_bf16;      // scales/biases are bfloat16, else float32
  bool x_bf16;           // x, out and bias are bfloat16, else float32
  const void* bias;      // [N] or null, in x's dtype
  float* out;            // [M, N] float32
  size_t M, N, K;
};

// A dot product of x and w (K long) in the dot-product kernels below is
// summed in this order whatever the build, the number of rows of x and the
// way a pass reads them: 32 lanes, lane l adding x[k] w[k] (a fused
// multiply-add in the builds with FMA) for k = l, l + 32, ... up to K
// rounded down to 8; lanes l and l + 16 added, then those 16 as l and
// l + 8; the 8 left in order; then the products from K rounded down to 8
// on. Four chains of 8 floats (two of 16 with AVX-512) keep a core's loads
// in flight where one chain of multiply-adds, each waiting on the one
// before, held a Xeon's float32 decode to 15 GB/s of weights
// (docs/benchmarks.md).
__attribute__((always_inline)) inline float finish(v8 sum, const float* x, const float* w, size_t k, size_t K) {
  float s = 0;
  for (int i = 0; i < 8; ++i) s += sum[i];
  for (size_t j = k; j < K; ++j) s += x[j] * w[j];
  return s;
}

// out[m] = x[m] . w for XR rows of x (K apart) and one row of w, in V
// vectors (v8, or v16 inside an AVX-512 function): 32 / lanes of V
// accumulators a row of x, then the tail in v8 as above. PREFETCH: w is a
// float32 matrix read in order, and the line 4 KB ahead is asked for into
// L2 as each line is read: a weight row of K = 1024 is a 4 KB page, where
// the CPU's own prefetcher stops and starts again (on the Xeon of
// docs/benchmarks.md 17 -> 23 GB/s on two threads, with the wider chains).
template <typename V, int XR, bool PREFETCH>
__attribute__((always_inline)) inline void row_dots(const float* x, size_t K, const float* w, float* out) {
  constexpr int L = sizeof(V) / sizeof(float), C = 32 / L;
  V acc[XR][C] = {};
  size_t k = 0;
  for (; k + 32 <= K; k += 32) {
    if constexpr (PREFETCH) {
#pragma GCC unroll 2
      for (int line = 0; line < 2; ++line) __builtin_prefetch(w + k + 16 * line + 1024, 0, 2);
    }
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      V wv;
      __builtin_memcpy(&wv, w + k + L * c, sizeof wv);
#pragma GCC unroll 4
      for (int m = 0; m < XR; ++m) {
        V xv;
        __builtin_memcpy(&xv, x + m * K + k + L * c, sizeof xv);
        acc[m][c] += xv * wv;
      }
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < XR; ++m) {
    v8 part[4];
    if constexpr (L == 16) {
      for (int c = 0; c < 2; ++c) {
        part[2 * c] = __builtin_shufflevector(acc[m][c], acc[m][c], 0, 1, 2, 3, 4, 5, 6, 7);
        part[2 * c + 1] = __builtin_shufflevector(acc[m][c], acc[m][c], 8, 9, 10, 11, 12, 13, 14, 15);
      }
    } else {
      for (int c = 0; c < 4; ++c) __builtin_memcpy(&part[c], &acc[m][c], sizeof(v8));
    }
    size_t j = k;
    for (int c = 0; j + 8 <= K; j += 8, ++c) {
      v8 wv, xv;
      __builtin_memcpy(&wv, w + j, sizeof wv);
      __builtin_memcpy(&xv, x + m * K + j, sizeof xv);
      part[c] += xv * wv;
    }
    out[m] = finish((part[0] + part[2]) + (part[1] + part[3]), x + m * K, w, j, K);
  }
}

// Eight quantized values starting at value k of a row, as floats (MLX's
// affine layout: value i sits at bits (i % per_word) * bits of word
// i / per_word, lowest bits first; little-endian, so 8-bit value i is byte i).
template <int BITS>
inline v8 unpack8(const uint8_t* row, size_t k) {
  if constexpr (BITS == 4) {
    uint32_t word;
    __builtin_memcpy(&word, row + k / 2, sizeof word);
    const u32x8 shifts = {0, 4, 8, 12, 16, 20, 24, 28};
    return __builtin_convertvector(__builtin_convertvector(((u32x8{} + word) >> shifts) & 15u, i32x8), v8);
  } else {
    // Bytes 0..7 from one broadcast 64-bit load: lanes hold bytes
    // 0,4,1,5,2,6,3,7, put back in order by one permute. (Converting a
    // vector of 8 bytes directly compiles to 8 scalar byte moves.)
    uint64_t bytes;
    __builtin_memcpy(&bytes, row + k, sizeof bytes);
    u64x4 b = u64x4{} + bytes;
    u32x8 words;
    __builtin_memcpy(&words, &b, sizeof words);
    const u32x8 shifts = {0, 0, 8, 8, 16, 16, 24, 24};
    v8 f = __builtin_convertvector(__builtin_convertvector((words >> shifts) & 255u, i32x8), v8);
    return __builtin_shufflevector(f, f, 0, 2, 4, 6, 1, 3, 5, 7);
  }
}

inline const uint8_t* packed_row(const Operands& o, size_t n) {
  return static_cast<const uint8_t*>(o.w) + n * o.K * format_bits(o.format) / 8;
}

// Row n of w as K floats in dst (w = q * scale + bias per group).
template <int BITS>
inline void decode_quantized_row(const Operands& o, size_t n, float* dst) {
  const uint8_t* row = packed_row(o, n);
  const size_t groups = o.K / o.group;
  for (size_t g = 0; g < groups; ++g) {
    const v8 s = v8{} + float_at(o.scales, n * groups + g, o.params_bf16);
    const v8 b = v8{} + float_at(o.biases, n * groups + g, o.params_bf16);
    // groups are 32, 64 or 128 values: whole vectors of 8
    for (size_t k = g * o.group; k < (g + 1) * o.group; k += 8) {
      v8 f = unpack8<BITS>(row, k) * s + b;
      __builtin_memcpy(dst + k, &f, sizeof f);
    }
  }
}

inline void decode_row(const Operands& o, size_t n, float* dst) {
  if (o.format == Format::Packed) return unpack_row(o.packed, n, dst);
  if (o.format == Format::Q4) return decode_quantized_row<4>(o, n, dst);
  if (o.format == Format::Q8) return decode_quantized_row<8>(o, n, dst);
  const uint16_t* src = static_cast<const uint16_t*>(o.w) + n * o.K;  // BF16
  size_t k = 0;
  for (; k + 8 <= o.K; k += 8) {
    u16x8 h;
    __builtin_memcpy(&h, src + k, sizeof h);
    u32x8 u = __builtin_convertvector(h, u32x8) << 16;
    __builtin_memcpy(dst + k, &u, sizeof u);
  }
  for (; k < o.K; ++k) dst[k] = bf16_to_f32(src[k]);
}

// out[m, n0:n1] for every row m of x: a weight row at a time (float32
// ones read in order, one stream; packed ones decoded in registers where
// packed_row_dots runs; others decoded into `scratch` first), met by up to
// MAXR rows of x a pass. Every out[m, n] is row_dots' sum, so a row of a
// many-row call (a verify call's) is bit for bit the row a one-row call (a
// decode step) computes, and a packed matrix's what its floats give.
template <typename V, int MAXR>
__attribute__((always_inline)) inline void linear_block(const Operands& o, size_t n0, size_t n1, float* scratch) {
  const size_t K = o.K;
  const bool stored = o.format == Format::F32;
  const bool packed_dots = sizeof(V) == 64 && o.format == Format::Packed && has_packed_dots();
  for (size_t n = n0; n < n1; ++n) {
    const float* w = static_cast<const float*>(o.w) + n * K;
    if (!stored && !packed_dots) decode_row(o, n, scratch), w = scratch;
    const float bias = o.bias ? float_at(o.bias, n, o.x_bf16) : 0.0f;
    float acc[MAXR];
    for (size_t m = 0; m < o.M;) {
      const float* x = o.x + m * K;
      size_t rows = 1;
      if (packed_dots) {
        rows = MAXR >= 4 && m + 4 <= o.M ? 4 : m + 2 <= o.M ? 2 : 1;
        packed_row_dots(o.packed, n, x, static_cast<int>(rows), acc);
      } else if (MAXR >= 4 && m + 4 <= o.M) {
        rows = 4, stored ? row_dots<V, 4, true>(x, K, w, acc) : row_dots<V, 4, false>(x, K, w, acc);
      } else if (m + 2 <= o.M) {
        rows = 2, stored ? row_dots<V, 2, true>(x, K, w, acc) : row_dots<V, 2, false>(x, K, w, acc);
      } else {
        stored ? row_dots<V, 1, true>(x, K, w, acc) : row_dots<V, 1, false>(x, K, w, acc);
      }
      for (size_t i = 0; i < rows; ++i, ++m) o.out[m * o.N + n] = acc[i] + bias;
    }
  }
}

void linear_block_generic(const Operands& o, size_t n0, size_t n1, float* scratch) {
  linear_block<v8, 2>(o, n0, n1, scratch);
}

// Rows n0 .. n0 + rows of w as floats, one after another in dst (K apart).
inline void decode_rows(const Operands& o, size_t n0, size_t rows, float* dst) {
  for (size_t r = 0; r < rows; ++r) decode_row(o, n0 + r, dst + r * o.K);
}

void decode_rows_generic(const Operands& o, size_t n0, size_t rows, float* dst) { decode_rows(o, n0, rows, dst); }

#if defined(__x86_64__)
// The same code compiled three times: for AVX-512 machines (16-float
// vectors, 32 registers: four rows of x a pass), for AVX2+FMA ones, and for
// any x86-64.
__attribute__((target("avx512f,avx512vl,avx2,fma"))) void linear_block_avx512(const Operands& o, size_t n0,
                                                                               size_t n1, float* scratch) {
  linear_block<v16, 4>(o, n0, n1, scratch);
}

__attribute__((target("avx2,fma"))) void linear_block_avx2(const Operands& o, size_t n0, size_t n1,
                                                            float* scratch) {
  linear_block<v8, 2>(o, n0, n1, scratch);
}

__attribute__((target("avx2,fma"))) void decode_rows_avx2(const Operands& o, size_t n0, size_t rows, float* dst) {
  decode_rows(o, n0, rows, dst);
}

#else
constexpr auto linear_block_avx512 = linear_block_generic;
constexpr auto linear_block_avx2 = linear_block_generic;
constexpr auto decode_rows_avx2 = decode_rows_generic;
#endif

// From this many rows of x on (prefill), a blocked GEMM (OpenBLAS) beats
// float dot products: each weight is then reused from registers and cache.
// (Quantized weights never take it: their integer kernel beats sgemm on
// decoded tiles at any number of rows.) Up to
// kDotRows rows (a decode step, a verify call: at most 16 rows), every row is
// computed exactly as a one-row call computes it (see linear_block), in
// floats or, quantized, in integers (quantized_dot.h).
constexpr size_t kGemmRows = kDotRows + 1;

// Weight rows per block of a dot-product call over N rows: about 8 blocks a
// thread (each claim of a block is an atomic both cores write, and a block's
// rows are one stream for the prefetcher), a multiple of `unit`.
size_t block_rows(size_t N, size_t unit) {
  return std::max(unit, (N / (8 * pool_size()) + unit - 1) / unit * unit);
}

// Rows n0 .. n0 + rows of a packed matrix against x (float_gemm_columns'
// layout): a few rows at a time decoded, then multiplied, while the next
// few rows' bytes are asked for. A whole tile decoded first left the core
// waiting on memory, then computing: a ~104M model's 64-token float32
// prefill 0.82x the stored floats'; 24 rows at a time 0.93x; the 6 that
// float_gemm meets at once for 64 rows of x, in L1, 0.94x.
void packed_tile(const Operands& o, const float* xt, size_t n0, size_t rows) {
  // what float_gemm meets at once in every chunk of x (whole chunks, then the rest)
  const size_t rest = o.M % kColumnRows;
  size_t group = o.M >= kColumnRows ? float_gemm_weight_rows(kColumnRows) : 1;
  if (rest) group = std::lcm(group, float_gemm_weight_rows(rest));
  thread_local std::vector<float> decoded;
  if (decoded.size() < group * o.K) decoded.resize(group * o.K);
  for (size_t g = 0; g < rows; g += group) {
    const size_t n = std::min(group, rows - g), next = std::min(group, rows - g - n);
    decode_rows(o, n0 + g, n, decoded.data());
    float_gemm(xt, o.M, o.K, decoded.data(), n, o.out + n0 + g, o.N, o.packed.row(n0 + g + n),
               next * packed_row_bytes(o.K, o.packed.narrow));
  }
}

// out = x w^T (+ bias), one tile of weight rows per task of our pool: our
// AVX-512 kernel (float_gemm.h) where the CPU has it, else OpenBLAS's sgemm
// (itself single-threaded: its own threads spin against ours and collapse
// when another process wants a core). Weights not stored as float32 are
// decoded a tile at a time, multiplied while in cache.
void gemm(const Operands& o) {
  use_single_threaded_blas();
  const size_t M = o.M, N = o.N, K = o.K;
  // Tiles of weight rows (decoded ones reused while in cache), whatever the
  // thread count: the same calls give the same bits with any number of
  // threads. OpenBLAS runs tiles of 256 at half the rate of 384 or more with
  // tens of rows of x (each call packs x again: a 64-token prompt, 11.6
  // against 25.5 GFLOP/s a core, numpy's OpenBLAS, 64 x 1024 x 32000 in
  // tiles); our kernel packs no weights (x once a product), and tiles of 96 rows share a layer's
  // products evenly between the threads (a 64-token fp32 prefill 761-878
  // tok/s against 751-758 with tiles of 512).
  const bool ours = has_avx512();
  const size_t tile = ours ? 96 : 512;
  const int tiles = static_cast<int>((N + tile - 1) / tile);
  std::vector<float> xt;
  if (ours) {
    xt.resize((M + kColumnRows - 1) / kColumnRows * kColumnRows * K);
    float_gemm_columns(o.x, M, K, xt.data());
  }
  parallel_for(tiles, [&](int t) {
    const size_t n0 = t * tile, rows = std::min(tile, N - n0);
    if (ours && o.format == Format::Packed) {
      packed_tile(o, xt.data(), n0, rows);
    } else {
      const float* w = static_cast<const float*>(o.w) + n0 * K;
      if (o.format != Format::F32) {
        thread_local std::vector<float> scratch;
        if (scratch.size() < rows * K) scratch.resize(rows * K);
        (has_avx2() ? decode_rows_avx2 : decode_rows_generic)(o, n0, rows, scratch.data());
        w = scratch.data();
      }
      if (ours) {
        float_gemm(xt.data(), M, K, w, rows, o.out + n0, N);
      } else {
        scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, rows, K, 1.0f, o.x, K, w, K, 0.0f, o.out + n0,
                          N);
      }
    }
    if (o.bias) {
      for (size_t m = 0; m < M; ++m) {
        for (size_t n = n0; n < n0 + rows; ++n) o.out[m * N + n] += float_at(o.bias, n, o.x_bf16);
      }
    }
  });
}

// Bytes of o's weight matrix (the packed values only, for the quantized formats).
size_t weight_bytes(const Operands& o) {
  return o.format == Format::Packed ? o.N * packed_row_bytes(o.K, o.packed.narrow)
                                    : o.N * o.K * format_bits(o.format) / 8;
}

// A decode-sized product's blocks of weight rows spread over the pool, the
// next products' weights read ahead around it (upcoming_weights.h).
void product_blocks(const Operands& o, int blocks, const std::function<void(int)>& fn) {
  product_starts(o.w, weight_bytes(o));
  parallel_for(blocks, fn);
  product_ends();
}

// out = x w^T (+ bias) for any weight format but the quantized formats'
// integer path: sgemm from kGemmRows rows of x on, dot products below.
void float_rows(const Operands& o) {
  if (o.M >= kGemmRows) return gemm(o);
  const size_t rows = block_rows(o.N, 4);
  const int blocks = static_cast<int>((o.N + rows - 1) / rows);
  const auto block = has_avx512() ? linear_block_avx512 : has_avx2() ? linear_block_avx2 : linear_block_generic;
  product_blocks(o, blocks, [&](int b) {
    thread_local std::vector<float> scratch;
    if (o.format != Format::F32 && scratch.size() < o.K) scratch.resize(o.K);
    const size_t n0 = b * rows, n1 = std::min(o.N, n0 + rows);
    block(o, n0, n1, scratch.data());
  });
}

// MLX primitive: inputs x [..., K] (any strides), w (+ scales, biases when
// quantized) (+ bias [N]), row-contiguous; output [..., N] in x's dtype.
class Linear : public CpuKernel {
 public:
  // Inputs x, the operands (w, or w, scales and biases), then the norm's
  // weight, the bias and the residual where given.
  Linear(mx::Stream s, Spec spec, std::optional<float> norm_eps, bool has_bias, bool has_residual)
      : CpuKernel(s), spec_(spec), norm_eps_(norm_eps), has_bias_(has_bias), has_residual_(has_residual) {}

  const char* name() const override { return "EmlxLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Linear&>(other);
    return spec_.format == o.spec_.format && spec_.group == o.spec_.group &&
           spec_.activations == o.spec_.activations && spec_.tiled == o.spec_.tiled && has_bias_ == o.has_bias_ &&
           has_residual_ == o.has_residual_ && norm_eps_ == o.norm_eps_;
  }

 private:
  CpuTask task() const override {
    return [spec = spec_, norm_eps = norm_eps_, has_bias = has_bias_, has_residual = has_residual_](
               const std::vector<mx::array>& inputs, mx::array& out) {
      const Format format = spec.format;
      const int group = spec.group;
      const bool tiled = spec.tiled;
      const auto& x = inputs[0];
      const bool quantized = format == Format::Q4 || format == Format::Q8;
      const bool packed_floats = format == Format::Packed;
      const size_t K = x.shape(-1), M = x.size() / K, N = out.shape(-1);
      std::vector<uint8_t> packed;
      const void* xdata = row_major_data<void>(x, packed);
      std::vector<float> x32, out32;
      Operands o{};
      o.format = format, o.group = group;
      o.M = M, o.N = N, o.K = K;
      o.x_bf16 = x.dtype() == mx::bfloat16;
      o.params_bf16 = quantized && inputs[2].dtype() == mx::bfloat16;
      if (o.x_bf16) {
        x32 = bf16_rows_to_f32(static_cast<const uint16_t*>(xdata), M * K);
        out32.resize(M * N);
      }
      o.x = o.x_bf16 ? x32.data() : static_cast<const float*>(xdata);
      o.out = o.x_bf16 ? out32.data() : out.data<float>();
      o.w = inputs[1].data<void>();
      if (quantized) o.scales = inputs[2].data<void>(), o.biases = inputs[3].data<void>();
      if (packed_floats) o.packed = packed_view(inputs[1], inputs[2], inputs[3], K);
      size_t next = quantized || packed_floats ? 4 : 2;  // the inputs after the operands
      std::vector<float> normed;
      if (norm_eps) {  // (float32 x only: build() normalizes others first) the norm's kernel's rows
        const float* weight = inputs[next++].data<float>();
        normed.resize(M * K);
        parallel_rows(M, 32, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) normalize_row(o.x + r * K, weight, *norm_eps, K, normed.data() + r * K);
        });
        o.x = normed.data();
      }
      o.bias = has_bias ? inputs[next].data<void>() : nullptr;
      IntRows xq;
      if (quantized && spec.activations == Activations::Int8 &&
          quantize_rows(o.x, M, K, group, format_bits(format), xq)) {
        // Integer dot products (quantized_dot.h), for any number of rows,
        // every row what a decode step computes; blocks of whole tiles of
        // 16 weight rows (the tiled layout's).
        const size_t rows = block_rows(N, kTileRows);
        const int blocks = static_cast<int>((N + rows - 1) / rows);
        product_blocks(o, blocks, [&](int b) {
          const size_t n0 = b * rows, n1 = std::min(N, n0 + rows);
          quantized_dots(xq, static_cast<const uint8_t*>(o.w), o.scales, o.biases, o.params_bf16, tiled, n0, n1, o.out,
                         N);
          if (!o.bias) return;
          for (size_t m = 0; m < M; ++m) {
            for (size_t n = n0; n < n1; ++n) o.out[m * N + n] += float_at(o.bias, n, o.x_bf16);
          }
        });
      } else if (tiled) {  // (x holds a NaN or an infinity) the weights back in rows, for this call only
        std::vector<uint8_t> bytes[3];
        const PackedRows rows = untile_matrix({static_cast<const uint8_t*>(o.w), o.scales, o.biases, o.params_bf16,
                                               group, format_bits(format)},
                                              N, K, bytes);
        o.w = rows.w, o.scales = rows.scales, o.biases = rows.biases;
        float_rows(o);
      } else {
        float_rows(o);
      }
      if (o.x_bf16) {
        // float32 -> bfloat16, rounding to nearest even (as MLX does)
        uint16_t* dst = reinterpret_cast<uint16_t*>(out.data<mx::bfloat16_t>());
        for (size_t i = 0; i < out32.size(); ++i) dst[i] = f32_to_bf16(out32[i]);
      }
      if (has_residual) {  // (float32 only: build() leaves the others to MLX)
        std::vector<uint8_t> packed_residual;
        const float* r = row_major_data<float>(inputs.back(), packed_residual);
        float* y = out.data<float>();
        for (size_t i = 0; i < M * N; ++i) y[i] += r[i];
      }
    };
  }

  Spec spec_;
  std::optional<float> norm_eps_;
  bool has_bias_, has_residual_;
};

void check_residual(const mx::array& x, int N, const std::optional<mx::array>& residual) {
  mx::Shape shape = x.shape();
  shape.back() = N;
  if (residual && (residual->shape() != shape || residual->dtype() != x.dtype())) {
    throw std::invalid_argument("linear layer: the residual must have the output's shape and x's dtype");
  }
}

// Our kernel over x as it is (it copies a strided one: a reshape to [M, K]
// and back would be two more nodes), the operands row-contiguous. `product`
// is MLX's x w^T for the fallback; the addends are added after it there too.
mx::array build(mx::StreamOrDevice sd, bool supported, mx::array x, std::vector<mx::array> operands,
                const LinearTerms& terms, Spec spec, const Fallback& product) {
  const auto& [norm, bias, residual] = terms;
  const mx::Stream s = mx::to_stream(sd);
  mx::Shape out_shape = x.shape();
  out_shape.back() = operands[0].shape(0);
  check_residual(x, operands[0].shape(0), residual);
  supported = supported && (!residual || x.dtype() == mx::float32);
  // The norm in our kernel (float32), else as its own op first.
  const bool fused_norm = norm && supported && CpuKernel::serves(s) && x.dtype() == mx::float32 &&
                          norm->weight.dtype() == mx::float32;
  if (norm && !fused_norm) x = rms_norm(x, norm->weight, norm->eps, s);
  const size_t count = operands.size();
  std::vector<mx::array> in = {x};
  for (auto& a : operands) in.push_back(supported ? row_contiguous(a) : a);
  if (fused_norm) in.push_back(row_contiguous(norm->weight));
  if (bias) in.push_back(supported ? row_contiguous(*bias) : *bias);
  if (residual) in.push_back(*residual);
  auto fallback = [product, count, has_bias = bias.has_value(), has_residual = residual.has_value()](
                      const std::vector<mx::array>& in, mx::Stream s) {
    auto y = product(in, s);
    if (has_bias) y = mx::add(y, in[1 + count], s);
    return has_residual ? mx::add(y, in.back(), s) : y;
  };
  // (a fused norm means our kernel: the fallback never sees its weight)
  const auto norm_eps = fused_norm ? std::optional<float>(norm->eps) : std::nullopt;
  return CpuKernel::build(s, supported, std::move(in), std::move(out_shape), x.dtype(), fallback, [&](mx::Stream s) {
    return std::make_shared<Linear>(s, spec, norm_eps, bias.has_value(), residual.has_value());
  });
}

}  // namespace

void check_quantization(const char* node, const QuantizedMatrix& q, int K) {
  const std::string name(node);
  const auto& w = q.w;
  const int group_size = q.group_size, bits = q.bits;
  const bool affine = q.mode == "affine";
  if (!affine && q.mode != "mxfp4") throw std::invalid_argument(name + ": unknown quantization mode " + q.mode);
  if (bits < 2 || bits > 8 || bits == 7) throw std::invalid_argument(name + ": bits must be 2, 3, 4, 5, 6 or 8");
  if (group_size != 32 && group_size != 64 && group_size != 128) {
    throw std::invalid_argument(name + ": group_size must be 32, 64 or 128");
  }
  if (!affine && (group_size != 32 || bits != 4)) throw std::invalid_argument(name + ": mxfp4 is 4 bits in groups of 32");
  if (w.ndim() != 2 || (w.dtype() != mx::uint32 && w.dtype() != mx::int32)) {
    throw std::invalid_argument(name + ": packed weight must be a 2-D 32-bit integer array");
  }
  if (K <= 0 || K % group_size != 0 || static_cast<int64_t>(w.shape(1)) * 32 != static_cast<int64_t>(K) * bits) {
    throw std::invalid_argument(name + ": packed weight width does not match K, bits and group_size");
  }
  const mx::Shape params = {w.shape(0), K / group_size};
  if (q.scales.shape() != params || (q.biases && q.biases->shape() != params)) {
    throw std::invalid_argument(name + ": scales and biases must be [N, K / group_size]");
  }
  if (!affine) {
    if (q.biases || q.scales.dtype() != mx::uint8) {
      throw std::invalid_argument(name + ": mxfp4 takes uint8 scales and no biases");
    }
    return;
  }
  if (!q.biases || !float32_or_bfloat16(q.scales.dtype()) || q.scales.dtype() != q.biases->dtype()) {
    throw std::invalid_argument(name + ": scales and biases must both be float32 or both bfloat16");
  }
}

// A norm's weight is [K].
void check_norm(const char* node, const std::optional<RowNorm>& norm, int K) {
  if (norm && (norm->weight.ndim() != 1 || norm->weight.shape(0) != K)) {
    throw std::invalid_argument(std::string(node) + ": the norm's weight must be [K]");
  }
}

mx::array linear(const mx::array& x, const mx::array& w, const LinearTerms& terms, mx::StreamOrDevice s) {
  const auto& bias = terms.bias;
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("LinearNode: x [..., K] and weight [N, K] expected");
  }
  if (bias && (bias->ndim() != 1 || bias->shape(0) != w.shape(0))) {
    throw std::invalid_argument("LinearNode: bias must be [N]");
  }
  check_norm("LinearNode", terms.norm, w.shape(1));
  const bool supported =
      float32_or_bfloat16(x.dtype()) && w.dtype() == x.dtype() && (!bias || bias->dtype() == x.dtype()) && w.shape(1) > 0;
  auto product = [](const std::vector<mx::array>& in, mx::Stream s) {
    return mx::matmul(in[0], mx::transpose(in[1], s), s);
  };
  return build(s, supported, x, {w}, terms, {x.dtype() == mx::float32 ? Format::F32 : Format::BF16}, product);
}

mx::array packed_float_linear(const mx::array& x, const PackedFloats& p, const LinearTerms& terms,
                              mx::StreamOrDevice s) {
  const auto& bias = terms.bias;
  const int N = p.rows.shape(0);
  if (x.ndim() < 1 || x.shape(-1) != p.K) throw std::invalid_argument("LinearNode: x [..., K] and weight [N, K] expected");
  if (x.dtype() != mx::float32 || (bias && bias->dtype() != mx::float32)) {
    // (other dtypes: MLX's product, with its type promotion, on the floats)
    return linear(x, packed_rows(p, mx::arange(N, mx::int32, s), s), terms, s);
  }
  if (bias && (bias->ndim() != 1 || bias->shape(0) != N)) throw std::invalid_argument("LinearNode: bias must be [N]");
  check_norm("LinearNode", terms.norm, p.K);
  auto unreachable = [](const std::vector<mx::array>&, mx::Stream) -> mx::array {
    throw std::logic_error("a packed float32 matrix read off our CPU kernels (matrices are packed only where they run)");
  };
  return build(s, true, x, {p.rows, p.starts, p.entries}, terms, {Format::Packed}, unreachable);
}

mx::array quantized_linear(const mx::array& x, const QuantizedMatrix& q, const LinearTerms& terms,
                           Activations activations, mx::StreamOrDevice s) {
  const auto& [norm, bias, residual] = terms;
  if (x.ndim() < 1) throw std::invalid_argument("QuantizedLinearNode: x must be [..., K]");
  const int K = x.shape(-1);
  check_quantization("QuantizedLinearNode", q, K);
  check_norm("QuantizedLinearNode", norm, K);
  if (bias && (bias->ndim() != 1 || bias->shape(0) != q.w.shape(0))) {
    throw std::invalid_argument("QuantizedLinearNode: bias must be [N]");
  }
  if (x.size() == 0) {  // no rows (MLX's quantized_matmul divides by their count)
    mx::Shape out = x.shape();
    out.back() = q.w.shape(0);
    return mx::zeros(out, x.dtype(), s);
  }
  const int group_size = q.group_size, bits = q.bits;
  if (q.mode != "affine") {  // MLX's own kernels read the microscaling formats
    check_residual(x, q.w.shape(0), residual);
    const auto xn = norm ? rms_norm(x, norm->weight, norm->eps, s) : x;
    auto y = mx::quantized_matmul(xn, mx::view(q.w, mx::uint32, s), q.scales, std::nullopt, /*transpose=*/true,
                                  group_size, bits, q.mode, s);
    if (bias) y = mx::add(y, *bias, s);
    return residual ? mx::add(y, *residual, s) : y;
  }
  // our kernel reads 4- and 8-bit codes; the other widths run on MLX's quantized_matmul
  const bool supported = (bits == 4 || bits == 8) && float32_or_bfloat16(x.dtype()) &&
                         float32_or_bfloat16(q.scales.dtype()) && (!bias || bias->dtype() == x.dtype());
  auto product = [group_size, bits, tiled = q.tiled](const std::vector<mx::array>& in, mx::Stream s) {
    auto rows = [&](const mx::array& a) { return tiled ? untiled(a, s) : a; };
    // (scales and biases in x's dtype: MLX's kernels compute in one type)
    auto param = [&](const mx::array& a) { return mx::astype(rows(a), in[0].dtype(), s); };
    return mx::quantized_matmul(in[0], mx::view(rows(in[1]), mx::uint32, s), param(in[2]), param(in[3]),
                                /*transpose=*/true, group_size, bits, "affine", s);
  };
  return build(s, supported, x, {q.w, q.scales, *q.biases}, terms,
               {bits == 4 ? Format::Q4 : Format::Q8, group_size, activations, q.tiled}, product);
}

mx::array untiled(const mx::array& a, mx::StreamOrDevice s) {
  const int rank = a.ndim(), N = a.shape(-2), C = a.shape(-1), lanes = static_cast<int>(kTileRows);
  const int tiles = N / lanes, whole = tiles * lanes;
  if (tiles == 0) return a;
  mx::Shape start(rank, 0), stop = a.shape(), shape(a.shape().begin(), a.shape().end() - 2);
  stop[rank - 2] = whole;
  auto head = mx::slice(a, start, stop, s);
  shape.insert(shape.end(), {tiles, C, lanes});
  head = mx::swapaxes(mx::reshape(head, shape, s), -1, -2, s);
  shape.resize(rank);
  shape[rank - 2] = whole, shape[rank - 1] = C;
  head = mx::reshape(head, shape, s);
  if (whole == N) return head;
  start[rank - 2] = whole, stop[rank - 2] = N;
  return mx::concatenate({head, mx::slice(a, start, stop, s)}, rank - 2, s);
}

std::vector<mx::array> take_rows(const std::vector<mx::array>& tables, const mx::array& ids, bool tiled,
                                 mx::StreamOrDevice s) {
  std::vector<mx::array> rows;
  const int N = tables.at(0).shape(0), lanes = static_cast<int>(kTileRows), tiles = N / lanes;
  if (!tiled || tiles == 0) {
    for (const auto& a : tables) rows.push_back(mx::take(a, ids, 0, s));
    return rows;
  }
  // which tile and lane each id is, computed once for all the tables
  const int whole = tiles * lanes;
  const auto type = ids.dtype();
  auto row = mx::where(mx::less(ids, mx::array(0, type), s), mx::add(ids, mx::array(N, type), s), ids, s);
  auto tile = mx::minimum(mx::floor_divide(row, mx::array(lanes, type), s), mx::array(tiles - 1, type), s);
  auto lane = mx::expand_dims(mx::remainder(row, mx::array(lanes, type), s), {-1, -2}, s);  // [..., 1, 1]
  std::optional<mx::array> in_tail, from_tiles;  // the rows after the last whole tile, if any
  if (whole < N) {
    in_tail = mx::maximum(mx::subtract(row, mx::array(whole, type), s), mx::array(0, type), s);
    from_tiles = mx::expand_dims(mx::less(row, mx::array(whole, type), s), -1, s);
  }
  for (const auto& a : tables) {
    // row r of a tile: its element c at [c, r] of the tile's [C, 16]
    const int C = a.shape(1);
    auto head = mx::reshape(mx::slice(a, {0, 0}, {whole, C}, s), {tiles, C, lanes}, s);
    auto picked = mx::take(head, tile, 0, s);  // [..., C, 16]
    auto shape = picked.shape();
    shape.back() = 1;
    auto got = mx::squeeze(mx::take_along_axis(picked, mx::broadcast_to(lane, shape, s), -1, s), -1, s);
    if (whole < N) got = mx::where(*from_tiles, got, mx::take(mx::slice(a, {whole, 0}, {N, C}, s), *in_tail, 0, s), s);
    rows.push_back(got);
  }
  return rows;
}

void float_linear_rows(const float* x, size_t M, size_t K, const void* w, bool w_bf16, size_t N, float* out) {
  Operands o{};
  o.format = w_bf16 ? Format::BF16 : Format::F32;
  o.x = x, o.w = w, o.out = out;
  o.M = M, o.N = N, o.K = K;
  float_rows(o);
}

void dequantized_linear_rows(const float* x, size_t M, size_t K, const PackedRows& w, size_t N, float* out) {
  Operands o{};
  o.format = w.bits == 4 ? Format::Q4 : Format::Q8;
  o.group = w.group;
  o.x = x, o.w = w.w, o.scales = w.scales, o.biases = w.biases, o.params_bf16 = w.params_bf16, o.out = out;
  o.M = M, o.N = N, o.K = K;
  float_rows(o);
}

}  // namespace emlx
