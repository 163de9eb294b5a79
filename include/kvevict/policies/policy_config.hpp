// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_POLICIES_POLICY_CONFIG_HPP
#define KVEVICT_POLICIES_POLICY_CONFIG_HPP

// A policy and its configuration as one value (compressor_options::policy). The holder does not
// know the policies: it stores whichever configuration a policy's traits name, so a new policy
// brings its configuration and its factory in its own traits header (docs/adding-a-policy.md)
// and nothing here changes.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/scoring/presets.hpp"

KVEVICT_NAMESPACE_BEGIN

/// A policy's kind: its index in the compressors' list of policies (default_policies,
/// policies/policy_list.hpp), which each traits header states as `kind` and the list checks.
/// The names are kvevict's first policies; a later one is policy_kind_of<its_traits>().
enum class policy_kind : std::int32_t { streaming_llm, knorm, h2o, snapkv, deferkv, dapq };

/// Which policy, its configuration, and ChunkKV on top. Build one with the factories of
/// namespace kvevict::policy (policy::snapkv(presets::kvpress_snapkv()), policy::deferkv(cfg),
/// ...), each declared beside its policy's traits; read or change the configuration with
/// config<Traits>() (the policy's own) or get_if<Traits>() (nullptr for another policy).
/// Default: SnapKV with kvpress's preset. chunk_length > 0 applies ChunkKV on top of the
/// scores of a policy whose traits are chunkable.
class policy_config {
 public:
  /// The largest configuration a policy may have (bytes); every one is trivially copyable.
  static constexpr std::size_t capacity = 256;

  policy_config() noexcept : kind_(policy_kind::snapkv) { new (storage_) window_config(presets::kvpress_snapkv()); }

  /// The policy of `Traits` configured by `c`.
  template <class Traits>
  static policy_config of(const typename Traits::config_type& c) noexcept {
    using C = typename Traits::config_type;
    static_assert(std::is_trivially_copyable<C>::value, "a policy configuration is a plain value");
    static_assert(sizeof(C) <= capacity && alignof(C) <= alignof(std::max_align_t),
                  "the policy configuration does not fit policy_config::capacity");
    policy_config p;
    p.kind_ = Traits::kind;
    new (p.storage_) C(c);
    return p;
  }

  policy_kind kind() const noexcept { return kind_; }
  std::int64_t chunk_length = 0;

  template <class Traits>
  bool holds() const noexcept {
    return kind_ == Traits::kind;
  }
  /// The configuration of the policy of `Traits`; nullptr when this holds another policy.
  template <class Traits>
  const typename Traits::config_type* get_if() const noexcept {
    return holds<Traits>() ? std::launder(reinterpret_cast<const typename Traits::config_type*>(storage_)) : nullptr;
  }
  template <class Traits>
  typename Traits::config_type* get_if() noexcept {
    return holds<Traits>() ? std::launder(reinterpret_cast<typename Traits::config_type*>(storage_)) : nullptr;
  }
  /// The configuration of the policy of `Traits`, which this must hold (the compressors ask
  /// only after dispatching on kind()); asking for another policy's aborts.
  template <class Traits>
  const typename Traits::config_type& config() const noexcept {
    const typename Traits::config_type* c = get_if<Traits>();
    if (c == nullptr) std::abort();
    return *c;
  }
  template <class Traits>
  typename Traits::config_type& config() noexcept {
    typename Traits::config_type* c = get_if<Traits>();
    if (c == nullptr) std::abort();
    return *c;
  }

  /// This policy's scores averaged per chunk of `length` tokens (ChunkKV).
  policy_config chunked(std::int64_t length = 20) const noexcept {
    policy_config p = *this;
    p.chunk_length = length;
    return p;
  }

 private:
  policy_kind kind_;
  alignas(std::max_align_t) unsigned char storage_[capacity];
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_POLICIES_POLICY_CONFIG_HPP
