// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_ERROR_HPP
#define KVEVICT_ERROR_HPP

// The single error type of kvevict. Every public entry point returns a `status`; a failed
// call leaves every cache, keep-list and state object exactly as it was. `status` needs
// neither exceptions nor heap allocation, so engines built with -fno-exceptions use the
// same API; engines that prefer exceptions call `throw_if_error`.

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "kvevict/config.hpp"

#if KVEVICT_HAS_EXCEPTIONS
#include <stdexcept>
#include <string>
#else
#include <cstdlib>
#endif

KVEVICT_NAMESPACE_BEGIN

/// What went wrong, coarse enough to branch on. The message says the rest.
enum class errc : std::int32_t {
  ok = 0,
  null_pointer,         ///< a required pointer is null
  invalid_shape,        ///< a size is out of its domain or disagrees with another
  invalid_stride,       ///< a stride is negative, or elements of a view overlap
  invalid_argument,     ///< a parameter value is outside its domain (budget, kernel, eta, ...)
  out_of_range,         ///< an index, position or block id points outside its range
  invalid_keep_list,    ///< a keep-list is unsorted, has duplicates, or does not fit
  workspace_too_small,  ///< the caller's workspace is smaller than the size query returned
  invalid_state,        ///< a stateful object is used out of lifecycle order
  overflow,             ///< a size does not fit the index type of the code path
  unsupported,          ///< a combination the library does not implement
  device_error,         ///< a CUDA runtime call failed
  collective_error,     ///< a collective of the engine's group failed, or another rank's part of the call did
};

/// Human-readable name of an error code ("invalid_stride", ...).
inline const char* to_string(errc code) noexcept {
  switch (code) {
    case errc::ok:
      return "ok";
    case errc::null_pointer:
      return "null_pointer";
    case errc::invalid_shape:
      return "invalid_shape";
    case errc::invalid_stride:
      return "invalid_stride";
    case errc::invalid_argument:
      return "invalid_argument";
    case errc::out_of_range:
      return "out_of_range";
    case errc::invalid_keep_list:
      return "invalid_keep_list";
    case errc::workspace_too_small:
      return "workspace_too_small";
    case errc::invalid_state:
      return "invalid_state";
    case errc::overflow:
      return "overflow";
    case errc::unsupported:
      return "unsupported";
    case errc::device_error:
      return "device_error";
    case errc::collective_error:
      return "collective_error";
  }
  return "unknown";
}

/// Result of a kvevict call: `ok()`, or an error code, the name of the offending argument
/// and a message of the form "kvevict::select: budget: expected >= 0, got -3".
/// Fixed-size and trivially copyable: returning it never allocates.
class [[nodiscard]] status {
 public:
  static constexpr std::size_t max_message = 240;

  constexpr status() noexcept = default;

  static constexpr std::size_t max_argument = 48;

  /// Builds an error about `argument` of `function` (both copied); `format` is printf-style
  /// and says what was expected and what was got.
  static status error(errc code, const char* function, const char* argument, const char* format, ...) noexcept
#if defined(__GNUC__) || defined(__clang__)
      __attribute__((format(printf, 4, 5)))
#endif
  {
    status s;
    s.code_ = code;
    std::snprintf(s.argument_, max_argument, "%s", argument);
    int n = std::snprintf(s.message_, max_message, "%s: %s: ", function, argument);
    if (n < 0) n = 0;
    if (static_cast<std::size_t>(n) < max_message) {
      std::va_list args;
      va_start(args, format);
      std::vsnprintf(s.message_ + n, max_message - static_cast<std::size_t>(n), format, args);
      va_end(args);
    }
    return s;
  }

  bool ok() const noexcept {
    return code_ == errc::ok;
  }
  errc code() const noexcept {
    return code_;
  }
  /// The argument the error is about ("" when ok).
  const char* argument() const noexcept {
    return argument_;
  }
  /// The full message ("" when ok).
  const char* message() const noexcept {
    return message_;
  }

 private:
  errc code_ = errc::ok;
  char argument_[max_argument] = {};
  char message_[max_message] = {};
};

#if KVEVICT_HAS_EXCEPTIONS
/// Exception thrown by `throw_if_error`; carries the original status.
class exception : public std::runtime_error {
 public:
  explicit exception(const status& s) : std::runtime_error(s.message()), status_(s) {}
  const status& error() const noexcept { return status_; }

 private:
  status status_;
};

/// For engines that use exceptions: turns a failed status into a `kvevict::exception`.
inline void throw_if_error(const status& s) {
  if (!s.ok()) throw exception(s);
}
#else
/// Without exceptions a failed status cannot propagate by throwing: print it and abort.
/// Engines built with -fno-exceptions should test `status::ok()` instead.
inline void throw_if_error(const status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message());
    std::abort();
  }
}
#endif

KVEVICT_NAMESPACE_END

/// Propagates a failed status from a kvevict call to the caller.
#define KVEVICT_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::kvevict::status kvevict_status_ = (expr);        \
    if (!kvevict_status_.ok()) return kvevict_status_; \
  } while (0)

#endif  // KVEVICT_ERROR_HPP
