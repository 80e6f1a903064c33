#include "packed_floats.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

constexpr uint32_t kException = 15;  // the offset that marks an exception

// Block b of a row: its offsets, then its mantissas (Byte: const or not).
template <typename Byte>
inline Byte* block_at(Byte* row, size_t K, bool narrow, size_t b) {
  return row + K / kPackedBlock + b * packed_block_bytes(narrow);
}

// Packs one row; appends its exceptions (column, bits) to `out`.
void pack_row_generic(const float* w, size_t K, bool narrow, uint8_t* row, std::vector<uint32_t>& out) {
  for (size_t b = 0; b < K / kPackedBlock; ++b) {
    uint32_t u[kPackedBlock];
    std::memcpy(u, w + b * kPackedBlock, sizeof u);
    uint32_t base = 0;
    for (uint32_t v : u) base = std::max(base, (v >> 23) & 255);
    row[b] = static_cast<uint8_t>(base);
    uint8_t* block = block_at(row, K, narrow, b);
    uint8_t offset[kPackedBlock];
    for (size_t i = 0; i < kPackedBlock; ++i) {
      offset[i] = static_cast<uint8_t>(std::min(base - ((u[i] >> 23) & 255), kException));
      if (narrow && (u[i] & 0xFFFF)) offset[i] = kException;
      if (offset[i] == kException) out.insert(out.end(), {static_cast<uint32_t>(b * kPackedBlock + i), u[i]});
      const uint32_t m = (u[i] & 0x7FFFFF) | (u[i] >> 31 << 23);
      if (narrow) {
        block[16 + i] = static_cast<uint8_t>(m >> 16);
        continue;
      }
      block[16 + 3 * i] = static_cast<uint8_t>(m), block[17 + 3 * i] = static_cast<uint8_t>(m >> 8);
      block[18 + 3 * i] = static_cast<uint8_t>(m >> 16);
    }
    for (size_t j = 0; j < 16; ++j) block[j] = static_cast<uint8_t>(offset[j] | offset[j + 16] << 4);
  }
}

#if defined(__x86_64__)
#define EMLX_VBMI __attribute__((target("avx512f,avx512bw,avx512vbmi,fma")))

// pack_row_generic's bytes, 16 weights a vector (a ~100M model loads ~1 s
// sooner than with the generic loop).
EMLX_VBMI void pack_row_vbmi(const float* w, size_t K, bool narrow, uint8_t* row, std::vector<uint32_t>& out) {
  alignas(64) uint8_t squeeze[64] = {};  // bytes 0-2 of each dword, 48 in a row (narrow: byte 2, 16)
  for (int i = 0; i < 16; ++i) {
    for (int j = 0; j < 3; ++j) squeeze[narrow ? i : 3 * i + j] = static_cast<uint8_t>(narrow ? 4 * i + 2 : 4 * i + j);
  }
  const __m512i to_bytes = _mm512_load_si512(squeeze), mantissa = _mm512_set1_epi32(0x7FFFFF);
  const __m512i exponent = _mm512_set1_epi32(255), exception = _mm512_set1_epi32(static_cast<int>(kException));
  const __mmask64 mantissa_bytes = narrow ? (__mmask64{1} << 16) - 1 : (__mmask64{1} << 48) - 1;
  const int mantissa_width = narrow ? 16 : 48;  // a half's bytes
  const __m512i low_bits = _mm512_set1_epi32(narrow ? 0xFFFF : 0);
  for (size_t b = 0; b < K / kPackedBlock; ++b) {
    const float* at = w + b * kPackedBlock;
    const __m512i u[2] = {_mm512_loadu_si512(at), _mm512_loadu_si512(at + 16)};
    const __m512i e[2] = {_mm512_and_si512(_mm512_srli_epi32(u[0], 23), exponent),
                          _mm512_and_si512(_mm512_srli_epi32(u[1], 23), exponent)};
    const uint32_t base = _mm512_reduce_max_epu32(_mm512_max_epu32(e[0], e[1]));
    row[b] = static_cast<uint8_t>(base);
    uint8_t* block = block_at(row, K, narrow, b);
    __m512i offset[2];
    for (int h = 0; h < 2; ++h) {
      offset[h] = _mm512_min_epu32(_mm512_sub_epi32(_mm512_set1_epi32(static_cast<int>(base)), e[h]), exception);
      // (narrow: a weight with low bits set is an exception)
      offset[h] = _mm512_mask_mov_epi32(offset[h], _mm512_test_epi32_mask(u[h], low_bits), exception);
      // sign and mantissa: u's low 23 bits, and u >> 8's bit 23 (the sign)
      const __m512i m = _mm512_ternarylogic_epi32(mantissa, u[h], _mm512_srli_epi32(u[h], 8), 0xCA);
      _mm512_mask_storeu_epi8(block + 16 + mantissa_width * h, mantissa_bytes, _mm512_permutexvar_epi8(to_bytes, m));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(block),
                     _mm512_cvtepi32_epi8(_mm512_or_si512(offset[0], _mm512_slli_epi32(offset[1], 4))));
    const uint32_t marked = _mm512_cmpeq_epi32_mask(offset[0], exception) |
                            static_cast<uint32_t>(_mm512_cmpeq_epi32_mask(offset[1], exception)) << 16;
    for (uint32_t left = marked; left; left &= left - 1) {
      const int i = __builtin_ctz(left);
      uint32_t bits;
      std::memcpy(&bits, at + i, sizeof bits);
      out.insert(out.end(), {static_cast<uint32_t>(b * kPackedBlock + i), bits});
    }
  }
}
#endif

void pack_row(const float* w, size_t K, bool narrow, uint8_t* row, std::vector<uint32_t>& out) {
#if defined(__x86_64__)
  if (has_packed_dots()) return pack_row_vbmi(w, K, narrow, row, out);
#endif
  pack_row_generic(w, K, narrow, row, out);
}

// Row n's exceptions written over dst.
inline void patch(const PackedView& p, size_t n, float* dst) {
  for (uint32_t e = p.starts[n]; e < p.starts[n + 1]; ++e) {
    std::memcpy(dst + p.entries[2 * e], &p.entries[2 * e + 1], sizeof(float));
  }
}

void unpack_row_generic(const PackedView& p, size_t n, float* dst) {
  const uint8_t* row = p.row(n);
  for (size_t b = 0; b < p.K / kPackedBlock; ++b) {
    const uint8_t* block = block_at(row, p.K, p.narrow, b);
    for (size_t i = 0; i < kPackedBlock; ++i) {
      const uint32_t offset = (block[i % 16] >> (i < 16 ? 0 : 4)) & 15;
      const uint32_t m = p.narrow ? static_cast<uint32_t>(block[16 + i]) << 16
                                  : block[16 + 3 * i] | block[17 + 3 * i] << 8 |
                                        static_cast<uint32_t>(block[18 + 3 * i]) << 16;
      const uint32_t u = (m & 0x7FFFFF) | (m >> 23 << 31) | ((row[b] - offset) & 255) << 23;
      std::memcpy(dst + b * kPackedBlock + i, &u, sizeof u);
    }
  }
  patch(p, n, dst);
}

#if defined(__x86_64__)
// Decodes blocks of 32 weights into two vectors of 16 (exceptions not
// applied: the caller patches the blocks that have them).
template <bool NARROW>
struct BlockDecoder {
  __m512i spread_low, spread_high, sign_and_mantissa, offsets_up;

  EMLX_VBMI BlockDecoder() {
    // byte 4i + j of a weight's dword <- mantissa byte 3i + min(j, 2): the
    // third byte twice, so that its top bit (the sign) lands on bit 31
    // (narrow: its one byte, bytes 0 and 1 zero)
    alignas(64) uint8_t spread[64];
    for (int i = 0; i < 16; ++i) {
      for (int j = 0; j < 4; ++j) spread[4 * i + j] = static_cast<uint8_t>(NARROW ? i : 3 * i + std::min(j, 2));
    }
    spread_low = _mm512_load_si512(spread);
    // (the high half: 16 bytes on in a narrow block, loaded 32 bytes on and 48 in a wide one)
    spread_high = _mm512_add_epi8(spread_low, _mm512_set1_epi8(16));
    sign_and_mantissa = _mm512_set1_epi32(static_cast<int>(0x807FFFFFu));
    offsets_up = _mm512_set_epi32(15 << 23, 14 << 23, 13 << 23, 12 << 23, 11 << 23, 10 << 23, 9 << 23, 8 << 23,
                                  7 << 23, 6 << 23, 5 << 23, 4 << 23, 3 << 23, 2 << 23, 1 << 23, 0);
  }

  EMLX_VBMI inline void decode(const uint8_t* row, size_t K, size_t b, __m512i& w0, __m512i& w1) const {
    const uint8_t* block = block_at(row, K, NARROW, b);
    // the 16 exponents the block's weights can have, by offset: vpermd picks by each lane's low 4 bits
    const __m512i exponents = _mm512_sub_epi32(_mm512_set1_epi32(static_cast<int>(row[b]) << 23), offsets_up);
    const __m512i offsets = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
    __m512i spread0, spread1;
    if constexpr (NARROW) {
      constexpr __mmask64 kHighBytes = 0xCCCCCCCCCCCCCCCCull;  // bytes 2 and 3 of each dword
      const __m512i bytes = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16)));
      spread0 = _mm512_maskz_permutexvar_epi8(kHighBytes, spread_low, bytes);
      spread1 = _mm512_maskz_permutexvar_epi8(kHighBytes, spread_high, bytes);
    } else {
      spread0 = _mm512_permutexvar_epi8(spread_low, _mm512_loadu_si512(block + 16));
      spread1 = _mm512_permutexvar_epi8(spread_high, _mm512_loadu_si512(block + 48));
    }
    // (spread & sign_and_mantissa) | exponent
    w0 = _mm512_ternarylogic_epi32(spread0, sign_and_mantissa, _mm512_permutexvar_epi32(offsets, exponents), 0xEA);
    w1 = _mm512_ternarylogic_epi32(spread1, sign_and_mantissa,
                                   _mm512_permutexvar_epi32(_mm512_srli_epi32(offsets, 4), exponents), 0xEA);
  }
};

// Row n's exceptions in block b, from `e` on, written over its weights u;
// returns the block of the next (or K / 32). (Not inlined: a kernel that
// takes the decoded vectors' addresses keeps them in memory.)
__attribute__((noinline)) size_t patch_block(const PackedView& p, size_t n, size_t b, uint32_t& e, uint32_t* u) {
  const uint32_t end = p.starts[n + 1];
  for (; e < end && p.entries[2 * e] / kPackedBlock == b; ++e) u[p.entries[2 * e] % kPackedBlock] = p.entries[2 * e + 1];
  return e < end ? p.entries[2 * e] / kPackedBlock : p.K / kPackedBlock;
}

template <bool NARROW>
EMLX_VBMI void unpack_row_vbmi(const PackedView& p, size_t n, float* dst) {
  const BlockDecoder<NARROW> decoder;
  const uint8_t* row = p.row(n);
  for (size_t b = 0; b < p.K / kPackedBlock; ++b) {
    __m512i w0, w1;
    decoder.decode(row, p.K, b, w0, w1);
    _mm512_storeu_si512(dst + b * kPackedBlock, w0);
    _mm512_storeu_si512(dst + b * kPackedBlock + 16, w1);
  }
  patch(p, n, dst);
}

// Two 16-float accumulators a row of x, as row_dots<v16, XR> keeps them.
template <int XR, bool NARROW>
EMLX_VBMI void dots(const PackedView& p, size_t n, const float* x, float* out) {
  const BlockDecoder<NARROW> decoder;  // (a local: its constants stay in registers)
  const size_t K = p.K, blocks = K / kPackedBlock;
  const uint8_t* row = p.row(n);
  uint32_t e = p.starts[n];
  size_t next = e < p.starts[n + 1] ? p.entries[2 * e] / kPackedBlock : blocks;
  __m512 acc[XR][2];
  for (int m = 0; m < XR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (size_t b = 0; b < blocks; ++b) {
    // rows are read in order, one stream: asked for into L2 4 KB ahead (a
    // row of K = 1024 is 3.6 KB), and into L1 1 KB ahead (the decoding
    // leaves fewer loads in flight than a float32 row's)
    const uint8_t* at = block_at(row, K, NARROW, b);
    __builtin_prefetch(at + 4096, 0, 2), __builtin_prefetch(at + 4096 + 64, 0, 2);
    __builtin_prefetch(at + 1024, 0, 3), __builtin_prefetch(at + 1024 + 64, 0, 3);
    __m512i w0, w1;
    decoder.decode(row, K, b, w0, w1);
    if (__builtin_expect(b == next, 0)) {
      alignas(64) uint32_t u[kPackedBlock];
      _mm512_store_si512(u, w0);
      _mm512_store_si512(u + 16, w1);
      next = patch_block(p, n, b, e, u);
      w0 = _mm512_load_si512(u);
      w1 = _mm512_load_si512(u + 16);
    }
    for (int m = 0; m < XR; ++m) {
      const float* xm = x + m * K + b * kPackedBlock;
      acc[m][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xm), _mm512_castsi512_ps(w0), acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 16), _mm512_castsi512_ps(w1), acc[m][1]);
    }
  }
  for (int m = 0; m < XR; ++m) {
    // row_dots' finish: lanes l and l + 16 added, then l and l + 8, then the 8 in order
    alignas(64) float a[2][16];
    _mm512_store_ps(a[0], acc[m][0]);
    _mm512_store_ps(a[1], acc[m][1]);
    float s = 0;
    for (int i = 0; i < 8; ++i) s += (a[0][i] + a[1][i]) + (a[0][i + 8] + a[1][i + 8]);
    out[m] = s;
  }
}
#undef EMLX_VBMI
#endif

}  // namespace

bool has_packed_dots() {
#if defined(__x86_64__)
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi");
  return yes;
#else
  return false;
#endif
}

bool pack_float32_weights() {
  const char* env = std::getenv("EMLX_PACKED_FLOAT32");
  if (env && std::string(env) == "0") return false;
  if (env && std::string(env) == "1") return true;
  if (env && *env) std::fprintf(stderr, "emlx: EMLX_PACKED_FLOAT32=%s ignored (0 or 1)\n", env);
  return has_packed_dots();
}

std::optional<bool> packing_of(const float* w, size_t N, size_t K) {
  if (N == 0 || K == 0 || K % kPackedBlock != 0 || K > UINT32_MAX) return std::nullopt;
  const size_t sampled = std::min<size_t>(N, 64);
  std::vector<uint8_t> row(packed_row_bytes(K, false));
  for (bool narrow : {true, false}) {
    std::vector<uint32_t> exceptions;
    for (size_t i = 0; i < sampled; ++i) pack_row(w + (i * N / sampled) * K, K, narrow, row.data(), exceptions);
    if (exceptions.size() / 2 * 256 <= sampled * K) return narrow;
  }
  return std::nullopt;
}

PackedView packed_view(const mx::array& rows, const mx::array& starts, const mx::array& entries, size_t K) {
  const bool narrow = static_cast<size_t>(rows.shape(1)) == packed_row_bytes(K, true);
  if (rows.ndim() != 2 || (!narrow && static_cast<size_t>(rows.shape(1)) != packed_row_bytes(K, false))) {
    throw std::invalid_argument("a packed float32 matrix's rows do not match its K");
  }
  return {rows.data<uint8_t>(), starts.data<uint32_t>(), entries.data<uint32_t>(), K, narrow};
}

PackedFloats pack_float32(const float* w, size_t N, size_t K, bool narrow, mx::array rows) {
  if (K % kPackedBlock != 0 || rows.nbytes() != N * packed_row_bytes(K, narrow)) {
    throw std::invalid_argument("pack_float32: K must be a multiple of 32 and rows [N, packed_row_bytes(K, narrow)]");
  }
  uint8_t* dst = rows.data<uint8_t>();
  // chunks of rows, each with its own exceptions, joined in order after
  constexpr int64_t kChunk = 64;
  const int64_t chunks = static_cast<int64_t>((N + kChunk - 1) / kChunk);
  std::vector<std::vector<uint32_t>> found(chunks);
  std::vector<uint32_t> per_row(N + 1, 0);
  parallel_rows(chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      for (size_t n = c * kChunk; n < std::min<size_t>(N, (c + 1) * kChunk); ++n) {
        const size_t before = found[c].size();
        pack_row(w + n * K, K, narrow, dst + n * packed_row_bytes(K, narrow), found[c]);
        per_row[n + 1] = static_cast<uint32_t>((found[c].size() - before) / 2);
      }
    }
  });
  mx::array starts(mx::allocator::malloc((N + 1) * sizeof(uint32_t)), {static_cast<int>(N + 1)}, mx::uint32);
  uint32_t* s = starts.data<uint32_t>();
  s[0] = 0;
  for (size_t n = 0; n < N; ++n) s[n + 1] = s[n] + per_row[n + 1];
  const size_t E = s[N];
  mx::array entries(mx::allocator::malloc(std::max<size_t>(E, 1) * 2 * sizeof(uint32_t)), {static_cast<int>(E), 2},
                    mx::uint32);
  uint32_t* at = entries.data<uint32_t>();
  for (const auto& f : found) at = std::copy(f.begin(), f.end(), at);
  return {std::move(rows), std::move(starts), std::move(entries), static_cast<int>(K), narrow};
}

void unpack_row(const PackedView& p, size_t n, float* dst) {
#if defined(__x86_64__)
  if (has_packed_dots()) return p.narrow ? unpack_row_vbmi<true>(p, n, dst) : unpack_row_vbmi<false>(p, n, dst);
#endif
  unpack_row_generic(p, n, dst);
}

void packed_row_dots(const PackedView& p, size_t n, const float* x, int xr, float* out) {
#if defined(__x86_64__)
  if (xr == 4) return p.narrow ? dots<4, true>(p, n, x, out) : dots<4, false>(p, n, x, out);
  if (xr == 2) return p.narrow ? dots<2, true>(p, n, x, out) : dots<2, false>(p, n, x, out);
  if (xr == 1) return p.narrow ? dots<1, true>(p, n, x, out) : dots<1, false>(p, n, x, out);
#endif
  throw std::logic_error("packed_row_dots: 1, 2 or 4 rows, on AVX-512 VBMI");
}

namespace {
// Inputs ids (int64, any shape), rows, starts, entries; output float32 [..., K].
class PackedRows : public CpuKernel {
 public:
  using CpuKernel::CpuKernel;
  const char* name() const override { return "EmlxPackedRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

 private:
  CpuTask task() const override {
    return [](const std::vector<mx::array>& inputs, mx::array& out) {
      const auto& ids = inputs[0];
      const PackedView p = packed_view(inputs[1], inputs[2], inputs[3], out.shape(-1));
      const int64_t N = inputs[1].shape(0);
      std::vector<uint8_t> packed;
      const int64_t* id = row_major_data<int64_t>(ids, packed);
      float* dst = out.data<float>();
      parallel_rows(static_cast<int64_t>(ids.size()), 16, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          int64_t n = id[r];
          n = std::clamp<int64_t>(n < 0 ? n + N : n, 0, N - 1);  // (in range already: never read outside)
          unpack_row(p, static_cast<size_t>(n), dst + r * p.K);
        }
      });
    };
  }
};
}  // namespace

mx::array packed_rows(const PackedFloats& p, const mx::array& ids, mx::StreamOrDevice s) {
  if (!mx::issubdtype(ids.dtype(), mx::integer)) throw std::invalid_argument("packed rows: integer indices expected");
  mx::Shape shape = ids.shape();
  shape.push_back(p.K);
  auto unreachable = [](const std::vector<mx::array>&, mx::Stream) -> mx::array {
    throw std::logic_error("packed float32 rows read off our CPU kernels (matrices are packed only where they run)");
  };
  return CpuKernel::build(s, true, {mx::astype(ids, mx::int64, s), p.rows, p.starts, p.entries}, std::move(shape), mx::float32, unreachable,
                          [](mx::Stream s) { return std::make_shared<PackedRows>(s); });
}

}  // namespace emlx
