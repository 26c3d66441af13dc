// Decode attention straight from the paged KV pool, on the CPU.
//
// One query per row (a decode token) attends over its sequence's keys, read where they
// lie in the pool through the row's block table (no gathered copy of the context), and,
// when given, over its own new key that is not in the pool yet. The query heads that
// share a KV head are done together, so each key row is converted to float once and
// used for all of them. Scores and the softmax are float32, whatever the pool's dtype.
//
// Built at run time by tokenfleet/model/attention/paged_cpu.py (torch's cpp_extension,
// -O3 -march=native) and registered as torch.ops.tokenfleet.decode_attention, so the
// compiled decode graph calls it as one extern kernel per layer.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// One row of hd values to float32: bf16 by its bit pattern (a shift the compiler
// vectorises; c10's scalar conversion does not), other types by a cast.
template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename T, int64_t HD>
void decode_attention_impl(
    const at::Tensor& q,       // [B, H, hd]
    const at::Tensor& k_pool,  // [layers, S, KVH, hd]
    const at::Tensor& v_pool,
    const c10::optional<at::Tensor>& k_new,  // [B, KVH, hd] or none
    const c10::optional<at::Tensor>& v_new,
    const at::Tensor& tables,  // [B, W] int32 block ids
    const at::Tensor& past,    // [B] int64: keys of each row already in the pool
    int64_t layer,
    int64_t block_size,
    int64_t window,  // 0: none; else a query at position p sees p - window + 1 .. p
    at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1);
  const int64_t hd = HD > 0 ? HD : q.size(2);  // a constant for the common head sizes
  const int64_t S = k_pool.size(1), KVH = k_pool.size(2), W = tables.size(1);
  const int64_t G = H / KVH;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const T* qp = q.data_ptr<T>();
  const T* kb = k_pool.data_ptr<T>() + layer * S * KVH * hd;
  const T* vb = v_pool.data_ptr<T>() + layer * S * KVH * hd;
  const T* kn = k_new.has_value() ? k_new->data_ptr<T>() : nullptr;
  const T* vn = v_new.has_value() ? v_new->data_ptr<T>() : nullptr;
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int64_t* pp = past.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  // A job is one row's KV head (its G query heads), the unit split between threads:
  // a one-row tick still has KVH of them to share. A thread's jobs are consecutive, so
  // one row's heads mostly go to one thread and it streams whole cache lines of the
  // pool (a row's keys of all heads lie side by side). Small ticks run on the calling
  // thread: waking the pool costs more than the work.
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, pp[b] + 1);
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (longest * hd * G));
  at::parallel_for(0, B * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), acc(G * hd), row(hd), scores, total(G);
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / KVH, kh = job % KVH;
      const int64_t n = pp[b];
      // the query sits at position n when its own key is given (not in the pool yet),
      // else at n - 1 (its key is the pool's last)
      const int64_t at = kn ? n : n - 1;
      const int64_t first = window > 0 ? std::max<int64_t>(0, at - window + 1) : 0;
      const int64_t L = n - first + (kn ? 1 : 0);
      scores.assign(G * std::max<int64_t>(L, 1), 0.0f);
      to_float(qp + (b * H + kh * G) * hd, qf.data(), G * hd);
      for (int64_t i = 0; i < G * hd; ++i) qf[i] *= scale;

      // key / value row j of this query's context: from the pool through the block
      // table, or (the last one, when given) its own new one
      auto row_of = [&](const T* pool, const T* fresh, int64_t j) -> const T* {
        const int64_t p = first + j;
        if (p == n) return fresh + (b * KVH + kh) * hd;
        const int64_t block = tp[b * W + p / block_size];
        return pool + ((block * block_size + p % block_size) * KVH + kh) * hd;
      };

      for (int64_t j = 0; j < L; ++j) {
        to_float(row_of(kb, kn, j), row.data(), hd);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * hd;
          float s = 0.0f;
          for (int64_t d = 0; d < hd; ++d) s += qg[d] * row[d];
          scores[g * L + j] = s;
        }
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * L;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < L; ++j) top = std::max(top, sg[j]);
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < L; ++j) {
          sg[j] = expf(sg[j] - top);  // vectorised through glibc's libmvec
          sum += sg[j];
        }
        total[g] = sum;
      }
      for (int64_t j = 0; j < L; ++j) {
        to_float(row_of(vb, vn, j), row.data(), hd);
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[g * L + j];
          float* ag = acc.data() + g * hd;
          for (int64_t d = 0; d < hd; ++d) ag[d] += w * row[d];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = total[g] > 0.0f ? 1.0f / total[g] : 0.0f;
        T* o = op + (b * H + kh * G + g) * hd;
        for (int64_t d = 0; d < hd; ++d) o[d] = static_cast<T>(acc[g * hd + d] * inv);
      }
    }
  });
}

at::Tensor decode_attention(
    const at::Tensor& q,
    const at::Tensor& k_pool,
    const at::Tensor& v_pool,
    const c10::optional<at::Tensor>& k_new,
    const c10::optional<at::Tensor>& v_new,
    const at::Tensor& tables,
    const at::Tensor& past,
    int64_t layer,
    int64_t block_size,
    int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 4, "q [B, H, hd], pools [layers, S, KVH, hd]");
  TORCH_CHECK(q.size(1) % k_pool.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(tables.scalar_type() == at::kInt && past.scalar_type() == at::kLong,
              "tables int32, past int64");
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "k_new and v_new go together");
  auto qc = q.contiguous();
  auto tc = tables.contiguous();
  auto pc = past.contiguous();
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "pools must be contiguous");
  c10::optional<at::Tensor> kc, vc;
  if (k_new.has_value()) {
    kc = k_new->contiguous();
    vc = v_new->contiguous();
  }
  auto out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention",
                                  [&] {
                                    auto run = [&](auto hd) {
                                      decode_attention_impl<scalar_t, decltype(hd)::value>(
                                          qc, k_pool, v_pool, kc, vc, tc, pc, layer, block_size,
                                          window, out);
                                    };
                                    switch (q.size(2)) {
                                      case 64: run(std::integral_constant<int64_t, 64>{}); break;
                                      case 128: run(std::integral_constant<int64_t, 128>{}); break;
                                      case 256: run(std::integral_constant<int64_t, 256>{}); break;
                                      default: run(std::integral_constant<int64_t, 0>{});
                                    }
                                  });
  return out;
}

}  // namespace

TORCH_LIBRARY(tokenfleet, m) {
  m.def(
      "decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor? k_new, Tensor? v_new, "
      "Tensor tables, Tensor past, int layer, int block_size, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) { m.impl("decode_attention", &decode_attention); }
