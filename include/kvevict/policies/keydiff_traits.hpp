// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_KEYDIFF_TRAITS_HPP
#define KVEVICT_POLICIES_KEYDIFF_TRAITS_HPP

// KeyDiff's configuration and its place in the compressors (policies/policy_traits.hpp);
// the policy itself is policies/keydiff.hpp.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_traits.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN

/// KeyDiff's fixed arithmetic, shared by kvevict::keydiff and cuda::keydiff_scores so that both
/// give the same bits. The floors are PyTorch's: F.normalize divides by max(||k||, 1e-12),
/// F.cosine_similarity by max(||k|| ||a||, 1e-8), so a zero key scores 0 rather than NaN. The
/// anchor sums each channel over chunks of anchor_chunk tokens, then the chunks' sums in order:
/// one fixed order, which a GPU runs chunk-parallel.
struct keydiff_arithmetic {
  static constexpr double normalize_eps = 1e-12;
  static constexpr double cosine_eps = 1e-8;
  static constexpr std::int64_t anchor_chunk = 256;
};

struct keydiff_config {
  std::int64_t protected_tail = 0;  ///< last tokens always kept (scored +inf)
  protected_mode protect = protected_mode::inside_budget;
};

template <class T, class Q>
class keydiff;

struct keydiff_traits : policy_traits_base {
  static constexpr const char* name = "keydiff";
  using config_type = keydiff_config;
  template <class T, class Q>
  using policy = keydiff<T, Q>;
  static constexpr bool chunkable = true;
  static constexpr bool reads_queries = false;  // scores compare keys with their own mean
  static constexpr bool on_gpu = true;          // cuda/detail/key_scorers.cuh

  static constexpr policy_kind kind = static_cast<policy_kind>(7);  // its index in default_policies
  static const config_type& config(const policy_config& p) noexcept { return p.config<keydiff_traits>(); }
  template <class O>
  static status check(O* o, std::int64_t* window, const char* fn) noexcept {
    const config_type& c = config(o->policy);
    if (c.protected_tail < 0)
      return status::error(errc::invalid_argument, fn, "policy.keydiff.protected_tail", "expected >= 0, got %lld",
                           static_cast<long long>(c.protected_tail));
    KVEVICT_RETURN_IF_ERROR(detail::check_protected_mode(c.protect, fn, "policy.keydiff.protect"));
    *window = 0;
    return status();
  }
  static selection_params largest_selection(const config_type& c) noexcept { return {c.protected_tail, c.protect}; }
};

namespace policy {
/// A compressor's policy: keydiff configured by `c`.
inline policy_config keydiff(const keydiff_config& c = {}) noexcept {
  return policy_config::of<keydiff_traits>(c);
}
}  // namespace policy

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_KEYDIFF_TRAITS_HPP
