// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_COMPILE_ONCE_HPP
#define KVEVICT_COMPRESSOR_COMPILE_ONCE_HPP

// Compile a compressor's run() once per program instead of in every translation unit that
// calls it. run() is where the optimiser spends nearly all of an engine TU's compile time
// (the kernels, selection and compaction it instantiates; docs/compile-cost.md), and both run()
// entries are non-inline templates (basic_compressor.hpp), so an explicit instantiation
// declaration keeps a TU from compiling them:
//
//   // engine header, seen by every TU that calls run():
//   using snapkv_compressor = kvevict::basic_compressor<kvevict::policy_list<kvevict::snapkv_traits>>;
//   KVEVICT_EXTERN_COMPRESSOR_RUN(snapkv_compressor, kvevict::bf16, kvevict::bf16);
//
//   // exactly one .cpp of the program (with the policies' headers included):
//   KVEVICT_INSTANTIATE_COMPRESSOR_RUN(snapkv_compressor, kvevict::bf16, kvevict::bf16);
//
// For the runtime-dtype entry (every storage and query type: the costliest TU of all) the
// class is named by its list, and every member that is not a template goes with it:
//
//   KVEVICT_EXTERN_COMPRESSOR(kvevict::default_policies);       // every TU
//   KVEVICT_INSTANTIATE_COMPRESSOR(kvevict::default_policies);  // one TU
//
// A TU that calls a run() no declaration covers compiles it as usual; a declaration without
// its instantiation fails to link, never at run time.

#include <cstdint>

#include "kvevict/compressor/basic_compressor.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/error.hpp"
#include "kvevict/workspace.hpp"

#define KVEVICT_DETAIL_COMPRESSOR_RUN(Compressor, T, Q)                                                    \
  ::kvevict::status Compressor::run<T, Q>(std::int64_t, const ::kvevict::sequence_io<T, Q>*, std::int64_t, \
                                          ::kvevict::sequence_report*, ::kvevict::workspace_span) const

/// run<T, Q>() of `Compressor` is compiled in another TU of the program.
#define KVEVICT_EXTERN_COMPRESSOR_RUN(Compressor, T, Q) extern template KVEVICT_DETAIL_COMPRESSOR_RUN(Compressor, T, Q)
/// Compiles run<T, Q>() of `Compressor` here (one TU of the program).
#define KVEVICT_INSTANTIATE_COMPRESSOR_RUN(Compressor, T, Q) template KVEVICT_DETAIL_COMPRESSOR_RUN(Compressor, T, Q)
/// Every member of basic_compressor<List> that is not a template, the runtime-dtype run()
/// included, is compiled in another TU of the program. (The typed run<T, Q> also takes an
/// any_sequence_io, so the runtime-dtype run() cannot be named alone: the class is.)
#define KVEVICT_EXTERN_COMPRESSOR(...) extern template class ::kvevict::basic_compressor<__VA_ARGS__>
/// Compiles every member of basic_compressor<List> that is not a template here.
#define KVEVICT_INSTANTIATE_COMPRESSOR(...) template class ::kvevict::basic_compressor<__VA_ARGS__>

#endif  // KVEVICT_COMPRESSOR_COMPILE_ONCE_HPP
