// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_IN_SEQUENCE_HPP
#define KVEVICT_DETAIL_IN_SEQUENCE_HPP

// Names of one sequence's arguments in a batched call ("seqs[3].keys.block_table"), shared by
// the compressor and the batched CUDA entries. Light: status only.

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// "seqs[3].keys" and the like.
struct io_name {
  char text[3 * status::max_argument];  // status::error truncates it to max_argument
  io_name(std::int64_t s, const char* field) noexcept {
    std::snprintf(text, sizeof(text), "seqs[%lld].%s", static_cast<long long>(s), field);
  }
  operator const char*() const noexcept { return text; }
};

/// `st` (an error about one sequence's argument) renamed to that sequence: "keys.block_table[3]"
/// becomes "seqs[2].keys.block_table[3]" ("seqs[2].layers[1].keys.block_table[3]" with prefix
/// "layers[1]."), the message keeps its text.
inline status in_sequence(const status& st, std::int64_t s, const char* fn, const char* prefix = "") noexcept {
  if (st.ok()) return st;
  const char* text = std::strstr(st.message(), ": ");
  text = text != nullptr ? std::strstr(text + 2, ": ") : nullptr;  // past "function: argument: "
  char name[2 * status::max_argument];                             // status::error truncates it to max_argument
  std::snprintf(name, sizeof(name), "seqs[%lld].%s%s", static_cast<long long>(s), prefix, st.argument());
  return status::error(st.code(), fn, name, "%s", text != nullptr ? text + 2 : st.message());
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_IN_SEQUENCE_HPP
