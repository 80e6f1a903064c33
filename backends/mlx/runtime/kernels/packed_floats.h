// Float32 matrices stored losslessly in about 28 bits a weight. A decode
// step streams every weight from memory once, at what the cores can pull, so
// fewer bytes is a faster step (a ~104M float32 model's decode 1.02-1.05x on
// a 2-core Xeon, its 64-token prefill 0.94x; 1.91x for bfloat16 values,
// packed narrow: docs/benchmarks.md). The
// program loader packs the float32 weights of linear layers (and their tied
// embedding tables) so where our CPU kernels run (Program::
// float32_matrices_to_pack); the products give bit for bit what the stored
// floats give.
//
// Weights within a block of 32 rarely span more than 2^14 in magnitude, so
// each weight keeps its sign and mantissa (24 bits) and its exponent as 4
// bits below the block's largest. A row of K weights (K a multiple of 32):
//   K / 32 bytes: each block's largest biased exponent;
//   then per block 112 bytes: 16 bytes of exponent offsets (byte j: weight
//   j's offset in its low 4 bits, weight j + 16's in its high 4), then 96
//   bytes of signs and mantissas (weight i's three bytes at 3 i, little-
//   endian: the 23 mantissa bits, then the sign as bit 23).
// A weight whose exponent is 15 or more below its block's (a zero in a block
// of others, say) has offset 15, and its 32 bits are an exception of its row.
//
// Narrow: a matrix of bfloat16 values (a bfloat16 checkpoint exported as
// float32: every weight's low 16 bits zero) keeps one byte of sign and
// mantissa a weight instead of three (the mantissa's top 7 bits, then the
// sign): 12.25 bits a weight, blocks of 48 bytes; a weight with low bits
// set is an exception.
#pragma once

#include <mlx/mlx.h>

#include <cstddef>
#include <cstdint>
#include <optional>

namespace emlx {

constexpr size_t kPackedBlock = 32;

// Bytes of a block's offsets and mantissas, and of a packed row of K weights.
constexpr size_t packed_block_bytes(bool narrow) { return 16 + (narrow ? 32 : 96); }
constexpr size_t packed_row_bytes(size_t K, bool narrow) { return K / kPackedBlock * (1 + packed_block_bytes(narrow)); }

// A packed [N, K] matrix.
struct PackedFloats {
  mlx::core::array rows;     // uint8 [N, packed_row_bytes(K, narrow)]
  mlx::core::array starts;   // uint32 [N + 1]: row n's exceptions are entries starts[n] .. starts[n + 1] - 1
  mlx::core::array entries;  // uint32 [E, 2]: (column, the weight's bits), by row, columns increasing
  int K;
  bool narrow;
};

// The same as pointers, for kernels.
struct PackedView {
  const uint8_t* rows;
  const uint32_t* starts;
  const uint32_t* entries;
  size_t K;
  bool narrow;
  const uint8_t* row(size_t n) const { return rows + n * packed_row_bytes(K, narrow); }
};

// A packed matrix's view from its arrays (a kernel's inputs): narrow or
// not by the rows' width.
PackedView packed_view(const mlx::core::array& rows, const mlx::core::array& starts, const mlx::core::array& entries,
                       size_t K);

// Whether a program loaded now packs its float32 matrices: EMLX_PACKED_FLOAT32=0
// never, =1 wherever our CPU kernels run, unset where the CPU runs
// packed_row_dots (x86 with AVX-512 VBMI). Read at each load.
bool pack_float32_weights();

// Whether packed_row_dots runs here (AVX-512 VBMI; EMLX_X86_KERNELS caps it).
bool has_packed_dots();

// How w [N, K] packs: nullopt when it does not (K not a multiple of 32, or
// in a sample of its rows more than 1 weight in 256 an exception: each
// costs 8 bytes and a slower block); else whether narrow (the sample's
// weights all bfloat16 values but that many).
std::optional<bool> packing_of(const float* w, size_t N, size_t K);

// w [N, K] packed into `rows` (uint8 [N, packed_row_bytes(K, narrow)],
// allocated), with its exceptions. Runs on our pool.
PackedFloats pack_float32(const float* w, size_t N, size_t K, bool narrow, mlx::core::array rows);

// Row n as K floats, exceptions included.
void unpack_row(const PackedView& p, size_t n, float* dst);

// out[m] = x[m] . (row n) for xr (1, 2 or 4) rows of x, K apart: each summed
// in linear.cpp's order for 16-float vectors (row_dots), so bit for bit what
// the unpacked row gives. Requires has_packed_dots().
void packed_row_dots(const PackedView& p, size_t n, const float* x, int xr, float* out);

// Rows `ids` (an integer array of any shape, each in [-N, N)) of the matrix:
// float32 [..., K]. TakeNode on a packed table (a tied embedding).
mlx::core::array packed_rows(const PackedFloats& p, const mlx::core::array& ids, mlx::core::StreamOrDevice s = {});

}  // namespace emlx
