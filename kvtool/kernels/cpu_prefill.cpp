// The elementwise work of an fp32 prefill on the CPU (many new tokens of a sequence), as torch ops
// (torch.ops.kvtool_cpu.*) beside those of cpu_decode.cpp, built into the same library by
// kvtool/kernels/cpu_decode.py. kvtool/models/cpu_prefill.py uses them and documents why.
//
// Each row is computed by one thread in a fixed order, so results do not depend on the thread count. Products
// and sums are not contracted into FMAs here (the pragma below), so RoPE rounds as the reference forward's
// x * cos + rotate_half(x) * sin does, bit for bit.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

#pragma GCC optimize("fp-contract=off")

namespace kvtool_cpu {
float dot(const float* a, const float* b, int64_t n);  // cpu_decode.cpp
}  // namespace kvtool_cpu

namespace {

// out [d] = RoPE (rotate_half convention, the row's cos/sin [d]) of in [d], after an RMSNorm with weight nw
// when nw is given (Qwen3's q_norm / k_norm). in and out may not overlap.
inline void norm_rope(const float* in, float* out, int64_t d, const float* nw, float eps, const float* cos,
                      const float* sin, float* scratch) {
  if (nw != nullptr) {
    const float scale = 1.f / std::sqrt(kvtool_cpu::dot(in, in, d) / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) scratch[i] = in[i] * scale * nw[i];
    in = scratch;
  }
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = in[i] * cos[i] - in[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = in[i] * cos[i] + in[i - half] * sin[i];
}

// The attention inputs of T new tokens of one sequence from the fused projection's output qkv [T, (hq + 2 hkv) d]:
// q and k normed (when q_norm/k_norm are given) and rotated at cos/sin [T, d]; k and v written for positions
// slot .. slot + T - 1: those below base to the blocks [2, L, hkv, B, d] (this layer's part; n B == base), the
// rest to the layer's buffers keys/values [1, hkv, capacity, d] from their slot 0. Returns q [T, hq, d]
// (token-major, as the projection wrote it; attention takes it as the view [1, hq, T, d]). The blocks and buffers
// are fp32 or bf16 alike (E: float, or uint16_t for bf16); K and V are computed in fp32 and rounded to bf16 as written.
template <class E>
at::Tensor rope_qkv_as(const at::Tensor& qkv, at::Tensor& keys, at::Tensor& values, int64_t slot,
                       const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& q_norm,
                       const std::optional<at::Tensor>& k_norm, double eps, int64_t hq, int64_t hkv,
                       at::TensorList blocks, int64_t layer, int64_t base) {
  TORCH_CHECK(qkv.is_contiguous() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.size(0) > 0,
              "rope_qkv: qkv must be contiguous fp32 [T, (hq + 2 hkv) d]");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0, "rope_qkv: hq must be a multiple of hkv");
  const int64_t rows = qkv.size(0), d = qkv.size(1) / (hq + 2 * hkv);
  TORCH_CHECK(qkv.size(1) == (hq + 2 * hkv) * d && d % 2 == 0 && d <= 1024,
              "rope_qkv: qkv's width must be (hq + 2 hkv) * head_dim, head_dim even and at most 1024");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                  sin.scalar_type() == at::kFloat && cos.numel() == rows * d && sin.numel() == rows * d,
              "rope_qkv: cos/sin must be contiguous fp32 [T, head_dim]");
  TORCH_CHECK(keys.is_contiguous() && values.is_contiguous() && keys.dim() == 4 && keys.sizes() == values.sizes() &&
                  keys.scalar_type() == values.scalar_type(),
              "rope_qkv: keys and values must be contiguous [1, hkv, capacity, d] of one dtype");
  TORCH_CHECK(keys.size(1) == hkv && keys.size(3) == d, "rope_qkv: head counts or head_dim do not match the buffers");
  int64_t bs = 1, nl = 0;
  const std::vector<E*> block = kvtool_cpu::block_pointers<E>(blocks, layer, hkv, d, bs, nl, "rope_qkv");
  const int64_t n = static_cast<int64_t>(block.size());
  TORCH_CHECK(base == n * (n ? bs : 0) && slot >= 0 && slot + rows - base <= keys.size(2), "rope_qkv: slots ", slot,
              "..", slot + rows - 1, " are outside ", n, " blocks (", base, " tokens) and the buffers' ", keys.size(2));
  for (const auto& w : {q_norm, k_norm}) {
    TORCH_CHECK(!w.has_value() || (w->is_contiguous() && w->scalar_type() == at::kFloat && w->numel() == d),
                "rope_qkv: q_norm/k_norm must be fp32 [head_dim]");
  }
  const float* qn = q_norm.has_value() ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = k_norm.has_value() ? k_norm->data_ptr<float>() : nullptr;
  const float e = static_cast<float>(eps);
  const int64_t width = qkv.size(1), cap = keys.size(2);
  at::Tensor q = at::empty({rows, hq, d}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  E* kp = static_cast<E*>(keys.data_ptr());
  E* vp = static_cast<E*>(values.data_ptr());
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float scratch[1024], rotated[1024];
    for (int64_t t = begin; t < end; ++t) {
      const float* row = in + t * width;
      const float* c = cp + t * d;
      const float* s = sp + t * d;
      for (int64_t h = 0; h < hq; ++h) norm_rope(row + h * d, qp + (t * hq + h) * d, d, qn, e, c, s, scratch);
      const int64_t pos = slot + t;
      for (int64_t g = 0; g < hkv; ++g) {
        const int64_t own = (g * cap + pos - base) * d;
        E* k = pos < base ? block[pos / bs] + ((layer * hkv + g) * bs + pos % bs) * d : kp + own;
        E* v = pos < base ? k + nl * hkv * bs * d : vp + own;
        norm_rope(row + (hq + g) * d, rotated, d, kn, e, c, s, scratch);
        kvtool_cpu::narrow_row(rotated, k, d);
        kvtool_cpu::narrow_row(row + (hq + hkv + g) * d, v, d);
      }
    }
  });
  return q;
}

at::Tensor rope_qkv(const at::Tensor& qkv, at::Tensor& keys, at::Tensor& values, int64_t slot, const at::Tensor& cos,
                    const at::Tensor& sin, const std::optional<at::Tensor>& q_norm,
                    const std::optional<at::Tensor>& k_norm, double eps, int64_t hq, int64_t hkv,
                    at::TensorList blocks, int64_t layer, int64_t base) {
  return kvtool_cpu::with_kv_type(keys.scalar_type(), "rope_qkv", [&](auto kind) {
    return rope_qkv_as<decltype(kind)>(qkv, keys, values, slot, cos, sin, q_norm, k_norm, eps, hq, hkv, blocks, layer,
                                       base);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvtool_cpu, m) {
  m.def("rope_qkv(Tensor qkv, Tensor(a!) keys, Tensor(b!) values, int slot, Tensor cos, Tensor sin, Tensor? q_norm, "
        "Tensor? k_norm, float eps, int hq, int hkv, Tensor[] blocks, int layer, int base) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvtool_cpu, CPU, m) {
  m.impl("rope_qkv", rope_qkv);
}
