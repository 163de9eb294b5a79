// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_COMPRESSOR_HPP
#define KVEVICT_COMPRESSOR_COMPRESSOR_HPP

// kvevict::compressor: the compressor serving every policy kvevict has (default_policies,
// policies/policy_list.hpp). See compressor/basic_compressor.hpp for the contract; an engine
// that uses a few policies plans basic_compressor over just those and compiles only them.

#include "kvevict/compressor/basic_compressor.hpp"
#include "kvevict/config.hpp"
#include "kvevict/policies/dapq.hpp"
#include "kvevict/policies/deferkv.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/keydiff.hpp"
#include "kvevict/policies/knorm.hpp"
#include "kvevict/policies/policy_list.hpp"
#include "kvevict/policies/snapkv.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/policies/tova.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Every policy of kvevict (policy_config::kind chooses one at plan time).
using compressor = basic_compressor<default_policies>;

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_COMPRESSOR_HPP
