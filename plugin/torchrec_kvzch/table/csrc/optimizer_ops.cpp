// The fused updates a table runs itself (table/row_optimizers.py, whose torch twin computes the
// same): Adam, partial row-wise Adam, row-wise Adagrad with an L2 decay, and fp16 SGD and
// row-wise Adagrad with a decay, over the rows a training batch touched. The batch's slots come sorted, so each distinct row is a run of
// them: a task sums the run's gradients (rows `source[i]` of `grad`, times `scale[i]`) into a
// buffer of its own and updates the row in place at once - no [rows, D] gradient tensor, and no
// two tasks on one row.

#include "id_map.h"

#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace kvzch {
namespace {

enum OwnKind : int64_t { kRowwiseAdagrad = 0, kAdam = 1, kPartialRowwiseAdam = 2, kSgd = 3 };

constexpr uint32_t kFp16Dropped = (1u << 13) - 1;  // fp32 mantissa bits an fp16 does not keep

// fp32 -> fp16, rounded stochastically as the twin's `_round`: the dropped bits get a random
// addend drawn from (id, column, step), then are cut.
inline at::Half stochastic_half(float x, uint64_t row_draw, int64_t column) {
  if (!std::isfinite(x)) return at::Half(x);
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint32_t draw = static_cast<uint32_t>(mix64(row_draw + static_cast<uint64_t>(column))) & kFp16Dropped;
  bits = (bits + draw) & ~kFp16Dropped;
  float rounded;
  std::memcpy(&rounded, &bits, 4);
  return at::Half(rounded);
}

template <typename W>
void own_update_rows(W* weights, float* state, const float* grad, const int64_t* slots,
                     const int64_t* source, const float* scale, const int64_t* ids,
                     const std::vector<int64_t>& starts, int64_t dim, int64_t floats, int64_t kind,
                     double lr, double eps, double beta1, double beta2, double decay, bool l2,
                     bool stochastic, int64_t step) {
  const float correction1 = static_cast<float>(1.0 - std::pow(beta1, static_cast<double>(step)));
  const float correction2 = static_cast<float>(1.0 - std::pow(beta2, static_cast<double>(step)));
  const uint64_t salt = static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull;
  const float b1 = static_cast<float>(beta1), b2 = static_cast<float>(beta2);
  const float flr = static_cast<float>(lr), feps = static_cast<float>(eps), wd = static_cast<float>(decay);
  const int64_t runs = static_cast<int64_t>(starts.size()) - 1;
  at::parallel_for(0, runs, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> g(dim), w(dim);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t row = slots[starts[r]];
      std::fill(g.begin(), g.end(), 0.0f);
      for (int64_t i = starts[r]; i < starts[r + 1]; ++i) {
        const float* from = grad + source[i] * dim;
        const float s = scale ? scale[i] : 1.0f;
        for (int64_t j = 0; j < dim; ++j) g[j] += s * from[j];
      }
      W* wrow = weights + row * dim;
      for (int64_t j = 0; j < dim; ++j) w[j] = static_cast<float>(wrow[j]);
      if (l2 && wd != 0.0f) {
        for (int64_t j = 0; j < dim; ++j) g[j] += wd * w[j];
      }
      float* s = state + row * floats;
      if (kind == kRowwiseAdagrad || kind == kSgd) {  // fbgemm's w = correction w - multiplier g
        float multiplier = flr;
        if (kind == kRowwiseAdagrad) {
          float squares = 0.0f;
          for (int64_t j = 0; j < dim; ++j) squares += g[j] * g[j];
          s[0] += squares / static_cast<float>(dim);  // (with an l2 decay: already in g)
          multiplier = flr / (std::sqrt(s[0]) + feps);
        }
        const float correction = l2 ? 1.0f : 1.0f - flr * wd;
        for (int64_t j = 0; j < dim; ++j) w[j] = correction * w[j] - multiplier * g[j];
      } else {
        const float keep = l2 ? 0.0f : wd;
        float* m = kind == kAdam ? s : s + 1;
        if (kind == kAdam) {
          float* v = s + dim;
          for (int64_t j = 0; j < dim; ++j) {
            v[j] = b2 * v[j] + (1.0f - b2) * (g[j] * g[j]);
            m[j] = b1 * m[j] + (1.0f - b1) * g[j];
            w[j] -= flr * (m[j] / correction1 / (std::sqrt(v[j] / correction2) + feps) + keep * w[j]);
          }
        } else {
          float squares = 0.0f;
          for (int64_t j = 0; j < dim; ++j) squares += g[j] * g[j];
          s[0] = b2 * s[0] + (1.0f - b2) * (squares / static_cast<float>(dim));
          const float denominator = std::sqrt(s[0] / correction2) + feps;
          for (int64_t j = 0; j < dim; ++j) {
            m[j] = b1 * m[j] + (1.0f - b1) * g[j];
            w[j] -= flr * (m[j] / correction1 / denominator + keep * w[j]);
          }
        }
      }
      if constexpr (std::is_same_v<W, at::Half>) {
        if (stochastic) {
          const uint64_t draw = mix64(static_cast<uint64_t>(ids[row]) + salt);
          for (int64_t j = 0; j < dim; ++j) wrow[j] = stochastic_half(w[j], draw, j);
          continue;
        }
      }
      for (int64_t j = 0; j < dim; ++j) wrow[j] = static_cast<W>(w[j]);
    }
  });
}

}  // namespace

// `slots` sorted ascending; `source`, `scale` (float32 [N] or empty: 1) in the same order;
// `ids`: each slot's id (the store's keys), for the stochastic rounding of fp16 rows.
void own_update_(at::Tensor weights, at::Tensor state, const at::Tensor& grad, const at::Tensor& slots,
                 const at::Tensor& source, const at::Tensor& scale, const at::Tensor& ids, int64_t kind,
                 double lr, double eps, double beta1, double beta2, double weight_decay, bool l2,
                 bool stochastic, int64_t step) {
  TORCH_CHECK(weights.dim() == 2 && weights.is_contiguous() && state.scalar_type() == at::kFloat &&
                  state.is_contiguous() && state.size(0) == weights.size(0),
              "kvzch own_update_: weights [R, D] and float32 state [R, F], contiguous");
  TORCH_CHECK(grad.scalar_type() == at::kFloat && grad.is_contiguous() && grad.size(1) == weights.size(1),
              "kvzch own_update_: grad must be contiguous float32 [P, D]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && source.scalar_type() == at::kLong &&
                  slots.is_contiguous() && source.is_contiguous() && slots.numel() == source.numel(),
              "kvzch own_update_: slots and source must be contiguous int64 of one length");
  TORCH_CHECK(scale.numel() == 0 || (scale.scalar_type() == at::kFloat && scale.is_contiguous() &&
                                      scale.numel() == slots.numel()),
              "kvzch own_update_: scale must be empty or contiguous float32 [N]");
  const int64_t n = slots.numel();
  const int64_t* s = slots.data_ptr<int64_t>();
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0 || s[i] != s[i - 1]) starts.push_back(i);
  }
  starts.push_back(n);
  const float* sc = scale.numel() ? scale.data_ptr<float>() : nullptr;
  const auto ids_c = ids.contiguous();
  const int64_t dim = weights.size(1), floats = state.size(1);
  if (weights.scalar_type() == at::kFloat) {
    own_update_rows(weights.data_ptr<float>(), state.data_ptr<float>(), grad.data_ptr<float>(), s,
                    source.data_ptr<int64_t>(), sc, ids_c.data_ptr<int64_t>(), starts, dim, floats, kind,
                    lr, eps, beta1, beta2, weight_decay, l2, stochastic, step);
  } else {
    TORCH_CHECK(weights.scalar_type() == at::kHalf, "kvzch own_update_: weights must be float32 or float16");
    own_update_rows(weights.data_ptr<at::Half>(), state.data_ptr<float>(), grad.data_ptr<float>(), s,
                    source.data_ptr<int64_t>(), sc, ids_c.data_ptr<int64_t>(), starts, dim, floats, kind,
                    lr, eps, beta1, beta2, weight_decay, l2, stochastic, step);
  }
}

}  // namespace kvzch

TORCH_LIBRARY_FRAGMENT(kvzch, m) {
  m.def(
      "own_update_(Tensor(a!) weights, Tensor(b!) state, Tensor grad, Tensor slots, Tensor source, Tensor scale, "
      "Tensor ids, int kind, float lr, float eps, float beta1, float beta2, float weight_decay, bool l2, "
      "bool stochastic, int step) -> ()");
}

TORCH_LIBRARY_IMPL(kvzch, CPU, m) { m.impl("own_update_", &kvzch::own_update_); }
