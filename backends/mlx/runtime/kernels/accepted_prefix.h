// Speculative verification's emitted tokens (AcceptedPrefixNode; the
// contract is docs/sampling.md's): which of the drafts a verify call fed are
// kept, as one task rather than a dozen small MLX ops each step.
#pragma once

#include <mlx/mlx.h>

namespace emlx {

// sampled [R] int64 (row i sampled after the last i + 1 fed tokens), fed
// [1, S] integers, S >= R, its last R entries the token and the drafts ->
// [R] int64: sampled[0 .. a], then -1, where a counts the leading drafts
// equal to the token sampled before them. On a CPU stream our kernel,
// elsewhere MLX ops.
mlx::core::array accepted_prefix(const mlx::core::array& sampled, const mlx::core::array& fed,
                                 mlx::core::StreamOrDevice s = {});

}  // namespace emlx
