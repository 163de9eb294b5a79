// kvevict/eigen.hpp: views over Eigen tensors and matrices address exactly the elements Eigen
// does, in both storage orders, with an outer stride, for float, Eigen::half and
// Eigen::bfloat16; and a policy scoring through such a view gives the bits it gives on the
// same values laid out by kvevict's own factory.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "kvevict/eigen.hpp"
#include "kvevict/kvevict.hpp"

namespace {

using i64 = std::int64_t;

template <class Scalar, int Layout>
void check_tensor_views() {
  const i64 heads = 3, tokens = 7, d = 5;
  Eigen::Tensor<Scalar, 3, Layout> t(heads, tokens, d);
  for (i64 h = 0; h < heads; ++h)
    for (i64 j = 0; j < tokens; ++j)
      for (i64 c = 0; c < d; ++c) t(h, j, c) = Scalar(static_cast<float>(h * 100 + j * 10 + c) / 64.0f);
  Eigen::TensorMap<Eigen::Tensor<Scalar, 3, Layout>> map(t.data(), heads, tokens, d);
  const auto keys = kvevict::eigen::cache_view_of(map);
  REQUIRE(keys.num_heads == heads);
  REQUIRE(keys.num_tokens == tokens);
  REQUIRE(keys.head_dim == d);
  std::vector<i64> positions(static_cast<std::size_t>(tokens));
  for (i64 j = 0; j < tokens; ++j) positions[static_cast<std::size_t>(j)] = 40 + j;
  const auto queries = kvevict::eigen::query_view_of(t, positions.data());
  for (i64 h = 0; h < heads; ++h)
    for (i64 j = 0; j < tokens; ++j)
      for (i64 c = 0; c < d; ++c) {
        const void* want = &map(h, j, c);
        REQUIRE(static_cast<const void*>(kvevict::probe_address(keys, j, h, c)) == want);
        REQUIRE(static_cast<const void*>(&queries.at(h, j, c)) == static_cast<const void*>(&t(h, j, c)));
      }
  REQUIRE(queries.positions[tokens - 1] == 40 + tokens - 1);
}

template <int Order>
void check_matrix_view() {
  const i64 heads = 2, tokens = 9, d = 4, pad = 3;
  using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Order>;
  // A token-major [L, Hkv * d] block inside a larger buffer: the map's outer stride skips `pad`.
  const i64 inner = Order == Eigen::RowMajor ? heads * d : tokens;
  const i64 outer = Order == Eigen::RowMajor ? tokens : heads * d;
  std::vector<float> buffer(static_cast<std::size_t>((inner + pad) * outer));
  Eigen::Map<matrix, 0, Eigen::OuterStride<>> m(buffer.data(), tokens, heads * d, Eigen::OuterStride<>(inner + pad));
  const auto keys = kvevict::eigen::token_major_cache_view_of(m, heads);
  REQUIRE(keys.num_heads == heads);
  REQUIRE(keys.num_tokens == tokens);
  REQUIRE(keys.head_dim == d);
  for (i64 h = 0; h < heads; ++h)
    for (i64 j = 0; j < tokens; ++j)
      for (i64 c = 0; c < d; ++c) REQUIRE(kvevict::probe_address(keys, j, h, c) == &m(j, h * d + c));
}

}  // namespace

TEST_CASE("Eigen tensors: cache and query views address Eigen's own elements", "[eigen]") {
  check_tensor_views<float, Eigen::RowMajor>();
  check_tensor_views<float, Eigen::ColMajor>();
  check_tensor_views<Eigen::half, Eigen::RowMajor>();
  check_tensor_views<Eigen::bfloat16, Eigen::ColMajor>();
  // The 16-bit Eigen scalars are viewed as kvevict's types of the same bits.
  Eigen::Tensor<Eigen::bfloat16, 3, Eigen::RowMajor> t(1, 1, 1);
  t(0, 0, 0) = Eigen::bfloat16(1.5f);
  const auto v = kvevict::eigen::cache_view_of(t);
  static_assert(std::is_same<decltype(v), const kvevict::cache_view<kvevict::bf16>>::value, "bf16 view");
  REQUIRE(static_cast<float>(*v.row(0, 0)) == 1.5f);
}

TEST_CASE("Eigen matrices: a token-major layer cache in either storage order, with an outer stride", "[eigen]") {
  check_matrix_view<Eigen::RowMajor>();
  check_matrix_view<Eigen::ColMajor>();
}

template <int Layout>
std::vector<float> eigen_vs_dense_scores(std::vector<float>* dense_scores) {
  const i64 hkv = 2, hq = 4, l = 33, d = 8, w = 4;
  Eigen::Tensor<float, 3, Layout> k(hkv, l, d);
  Eigen::Tensor<float, 3, Eigen::RowMajor> q(hq, w, d);
  k.setRandom();
  q.setRandom();
  std::vector<float> dense(static_cast<std::size_t>(hkv * l * d));
  for (i64 h = 0; h < hkv; ++h)
    for (i64 j = 0; j < l; ++j)
      for (i64 c = 0; c < d; ++c) dense[static_cast<std::size_t>((h * l + j) * d + c)] = k(h, j, c);
  std::vector<i64> positions(static_cast<std::size_t>(w));
  for (i64 t = 0; t < w; ++t) positions[static_cast<std::size_t>(t)] = l - w + t;

  kvevict::window_config config = kvevict::presets::kvpress_snapkv();
  config.window = w;
  const kvevict::snapkv<float> policy(config);
  kvevict::workspace ws(policy.workspace_size({hq, hkv, d, l, w}));
  const auto score = [&](kvevict::cache_view<const float> keys) {
    kvevict::layer_inputs<float> in;
    in.keys = keys;
    in.queries = kvevict::eigen::query_view_of(q, positions.data());
    std::vector<float> out(static_cast<std::size_t>(hkv * l));
    const kvevict::status st = policy.score(in, {out.data(), hkv, l, l}, ws);
    INFO(st.message());
    REQUIRE(st.ok());
    return out;
  };
  *dense_scores = score(kvevict::hf_contiguous<const float>(dense.data(), hkv, l, d, l));
  return score(kvevict::eigen::cache_view_of(k));
}

TEST_CASE("a policy scores an Eigen-held cache as it scores kvevict's own layout of the same values", "[eigen]") {
  std::vector<float> dense;
  // Row-major [Hkv, L, d] is kvevict's hf_contiguous layout: the same bits.
  REQUIRE(eigen_vs_dense_scores<Eigen::RowMajor>(&dense) == dense);
  // Column-major puts channels Hkv*L apart: the strided kernels sum in another order.
  const std::vector<float> col = eigen_vs_dense_scores<Eigen::ColMajor>(&dense);
  REQUIRE(col.size() == dense.size());
  for (std::size_t i = 0; i < col.size(); ++i) REQUIRE(col[i] == Approx(dense[i]).epsilon(1e-5));
}
