#include "accepted_prefix.h"

#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

class AcceptedPrefix : public CpuKernel {
 public:
  using CpuKernel::CpuKernel;

  const char* name() const override { return "EmlxAcceptedPrefix"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

 private:
  CpuTask task() const override {
    return [](const std::vector<mx::array>& inputs, mx::array& out) {
      const auto &sampled = inputs[0], &fed = inputs[1];
      const int64_t R = sampled.shape(0), S = fed.shape(1);
      const auto token = [&](int64_t i) { return integer_at(sampled, i * sampled.strides()[0]); };
      const auto draft = [&](int64_t i) { return integer_at(fed, (S - R + i) * fed.strides()[1]); };  // d_i
      int64_t accepted = 0;  // the first row whose token does not confirm the draft after it (the last row's none)
      while (accepted < R - 1 && token(accepted) == draft(accepted + 1)) ++accepted;
      int64_t* to = out.data<int64_t>();
      for (int64_t i = 0; i < R; ++i) to[i] = i <= accepted ? token(i) : -1;
    };
  }
};

}  // namespace

mx::array accepted_prefix(const mx::array& sampled, const mx::array& fed, mx::StreamOrDevice s) {
  if (sampled.ndim() != 1 || sampled.dtype() != mx::int64) {
    throw std::invalid_argument("AcceptedPrefixNode: sampled must be [R] int64");
  }
  if (fed.ndim() != 2 || fed.shape(0) != 1 || fed.shape(1) < sampled.shape(0)) {
    throw std::invalid_argument("AcceptedPrefixNode: fed must be [1, S] with S >= R (the sampled rows)");
  }
  if (!mx::issubdtype(fed.dtype(), mx::integer)) throw std::invalid_argument("AcceptedPrefixNode: fed must be integers");
  const int R = sampled.shape(0);
  if (R == 0) return sampled;
  auto fallback = [](const std::vector<mx::array>& in, mx::Stream s) {
    const auto& sampled = in[0];
    const int R = sampled.shape(0), S = in[1].shape(1);
    const auto fed = mx::reshape(mx::slice(mx::astype(in[1], mx::int64, s), {0, S - R}, {1, S}, s), {R}, s);
    const auto i = mx::arange(R, mx::int64, s);
    const auto following = mx::take(fed, mx::minimum(mx::add(i, mx::array(1, mx::int64), s), mx::array(R - 1, mx::int64), s), 0, s);
    const auto match = mx::logical_and(mx::equal(sampled, following, s), mx::less(i, mx::array(R - 1, mx::int64), s), s);
    const auto accepted = mx::astype(mx::argmin(mx::astype(match, mx::int32, s), 0, false, s), mx::int64, s);
    return mx::where(mx::less_equal(i, accepted, s), sampled, mx::array(-1, mx::int64), s);
  };
  return CpuKernel::build(s, true, {sampled, fed}, sampled.shape(), mx::int64, fallback,
                          [](mx::Stream s) { return std::make_shared<AcceptedPrefix>(s); });
}

}  // namespace emlx
