// Decode attention straight from the paged KV pool, on the CPU.
//
// One query per row (a decode token) attends over its sequence's keys, read where they
// lie in the pool through the row's block table (no gathered copy of the context), and,
// when given, over its own new key that is not in the pool yet. The query heads that
// share a KV head are done together, so each key row is converted to float once and
// used for all of them. Scores and the softmax are float32, whatever the pool's dtype.
// The pool's dtype is the query's, or float16 under a float32 query (a float32 model
// with a float16 pool: half the bytes a tick reads from it; docs/operations.md).
//
// Built at run time by tokenfleet/model/attention/paged_cpu.py (torch's cpp_extension,
// -O3 -march=native) and registered as torch.ops.tokenfleet.decode_attention, so the
// compiled decode graph calls it as one extern kernel per layer.
//
// The same library holds torch.ops.tokenfleet.int8_linear and q4_linear (after it): int8
// weights, and int4 ones in llama.cpp's Q4_1 blocks, times int8-quantized activations on
// AVX512-VNNI or AVX2, for model/quant.py; and the native decode stack (at the end).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__)
#define TOKENFLEET_BF16_DOT 1
#endif

namespace {

#ifdef TOKENFLEET_BF16_DOT
// The bf16 path on CPUs with AVX512-BF16 (Zen 4, Zen 5, Xeons since Cooper Lake): a
// score is q . k summed by vdpbf16ps straight from the bf16 rows (each product exact in
// float32, the sum float32), and a value row is widened 16 lanes at a time into
// accumulators held in registers across the keys. The plain loops below widen every
// key and value row through memory and keep the accumulators there: 1.5-2.4x slower
// (SmolLM2's shape on an EPYC Zen 4, 8 rows and 1).

inline __m512 widen16(const uint16_t* p) {  // 16 bf16 -> 16 float32 (exact)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline __m512 round16(__m512 x) {  // to bf16 and back (nearest even)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

// Ask for a row of HD bf16 values ahead of its use. A context's rows lie in blocks
// scattered over the pool (16 rows of all KV heads each, one head's row every
// KVH * HD values), so the hardware prefetcher loses the stream at every block edge.
template <int64_t HD>
inline void prefetch_row(const void* p) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < HD * 2; b += 64) _mm_prefetch(c + b, _MM_HINT_T0);
}

template <int64_t HD>
inline float dot_bf16(const uint16_t* a, const uint16_t* b) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < HD; c += 32) {
    const __m512bh x = (__m512bh)_mm512_loadu_si512(a + c);
    const __m512bh y = (__m512bh)_mm512_loadu_si512(b + c);
    acc = _mm512_dpbf16_ps(acc, x, y);
  }
  return _mm512_reduce_add_ps(acc);
}

// The 16 lane sums of v[0..15], lane k = sum of v[k]: a tree of adds over shuffled
// halves (about 3 instructions a key, where one reduce_add each takes 8 or more).
inline __m512 sum16(__m512 v[16]) {
  __m512 w[8], u[4];
  for (int i = 0; i < 8; ++i) {  // quarters 0-1: v[2i] in 8 lanes, 2-3: v[2i+1]
    const __m512 lo = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 hi = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2));
    w[i] = _mm512_add_ps(lo, hi);
  }
  for (int i = 0; i < 4; ++i) {  // quarter q: v[4i + q] in 4 lanes
    const __m512 lo = _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 hi = _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
    u[i] = _mm512_add_ps(lo, hi);
  }
  // within each quarter q, a 4x4 transpose-add: lane m of quarter q = sum of v[4m + q]
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(u[0], u[1]), _mm512_unpackhi_ps(u[0], u[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(u[2], u[3]), _mm512_unpackhi_ps(u[2], u[3]));
  const __m512d a = _mm512_castps_pd(s01), b = _mm512_castps_pd(s23);
  const __m512 r = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  // lane 4q + m holds v[4m + q]: put v[k] in lane k
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// scores of one query row against 16 key rows, times scale
template <int64_t HD>
inline void dot16_bf16(const uint16_t* q, const uint16_t* const* k, float scale, float* out) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < HD; c += 32) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(q + c);
      const __m512bh y = (__m512bh)_mm512_loadu_si512(k[j] + c);
      acc[j] = _mm512_dpbf16_ps(acc[j], x, y);
    }
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
}

// acc[g][:] = sum over j of w[g][j] * V[j][:] for GN (<= 4) query heads at once; the
// GN x HD/16 accumulators stay in registers. pump() is called every 16 keys (the
// attention's prefetch of the next row's context).
template <int64_t HD, int GN, typename RowOf, typename Pump>
inline void weigh_values(const float* w, int64_t L, RowOf row_of, float* acc, Pump& pump) {
  constexpr int64_t C = HD / 16;
  __m512 a[GN][C];
  for (int g = 0; g < GN; ++g)
    for (int64_t c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  constexpr int64_t ahead = 8;  // rows
  for (int64_t j = 0; j < L; ++j) {
    if (j % 16 == 0) pump();
    if (j + ahead < L) prefetch_row<HD>(row_of(j + ahead));
    const uint16_t* v = row_of(j);
    __m512 x[C];
    for (int64_t c = 0; c < C; ++c) x[c] = widen16(v + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 wg = _mm512_set1_ps(w[g * L + j]);
      for (int64_t c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(wg, x[c], a[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int64_t c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * HD + 16 * c, a[g][c]);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
#define TOKENFLEET_AVX2_ATTN 1
// The AVX2 path (CPUs without AVX512-BF16 such as the EPYC Zen 2 / Zen 3, and float32
// pools on any CPU with AVX2): a score is 8 float32 lanes of q * k products across the
// head, and 8 keys' lanes are folded into one register of 8 scores by a tree of
// horizontal adds; a value row is widened 8 lanes at a time into accumulators held in
// registers across the keys, the head split into column passes that fit AVX2's 16
// registers. The plain loops below widen every row through memory and sum one score
// at a time.

inline __m256 widen8(const c10::BFloat16* p) {  // 8 bf16 -> 8 float32 (exact)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 widen8(const float* p) { return _mm256_loadu_ps(p); }
#if defined(__F16C__)
#define TOKENFLEET_F16_WIDEN 1
inline __m256 widen8(const c10::Half* p) {  // 8 float16 -> 8 float32 (exact, vcvtph2ps)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

template <int64_t HD, typename T>
inline void prefetch_row8(const T* p) {  // as prefetch_row, for either element type
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t b = 0; b < HD * static_cast<int64_t>(sizeof(T)); b += 64)
    _mm_prefetch(c + b, _MM_HINT_T0);
}

// the scores of one query row (float32, already scaled) against 8 key rows
template <int64_t HD, typename T>
inline __m256 dot8(const float* q, const T* const* k) {
  __m256 s[8];
  for (int i = 0; i < 8; ++i) {
    s[i] = _mm256_setzero_ps();
    for (int64_t c = 0; c < HD; c += 8)
      s[i] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), widen8(k[i] + c), s[i]);
  }
  // lane i of the result: the sum of s[i]'s lanes
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

template <int64_t HD, typename T>
inline float dot1(const float* q, const T* k) {
  __m256 s = _mm256_setzero_ps();
  for (int64_t c = 0; c < HD; c += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(q + c), widen8(k + c), s);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// acc[g][:] = sum over j of w[g][j] * V[j][:] for GN (<= 4) query heads, C columns of 8
// at a time (GN x C accumulators, GN weights and one value register live). The first
// pass asks for whole rows ahead, so the later passes find them in the cache. pump() is
// called every 16 keys of the first pass.
template <int64_t HD, int GN, typename T, typename RowOf, typename Pump>
inline void weigh_values8(const float* w, int64_t L, RowOf row_of, float* acc, Pump& pump) {
  constexpr int64_t C = GN == 1 ? 8 : GN <= 3 ? 4 : 2;
  constexpr int64_t step = HD % (8 * C) == 0 ? 8 * C : 8;
  constexpr int64_t cols = step / 8;
  constexpr int64_t ahead = 8;  // rows
  for (int64_t c0 = 0; c0 < HD; c0 += step) {
    __m256 a[GN][cols];
    for (int g = 0; g < GN; ++g)
      for (int64_t c = 0; c < cols; ++c) a[g][c] = _mm256_setzero_ps();
    for (int64_t j = 0; j < L; ++j) {
      if (c0 == 0 && j % 16 == 0) pump();
      if (c0 == 0 && j + ahead < L) prefetch_row8<HD>(row_of(j + ahead));
      const T* v = row_of(j) + c0;
      __m256 wg[GN];
      for (int g = 0; g < GN; ++g) wg[g] = _mm256_set1_ps(w[g * L + j]);
      for (int64_t c = 0; c < cols; ++c) {
        const __m256 x = widen8(v + 8 * c);
        for (int g = 0; g < GN; ++g) a[g][c] = _mm256_fmadd_ps(wg[g], x, a[g][c]);
      }
    }
    for (int g = 0; g < GN; ++g)
      for (int64_t c = 0; c < cols; ++c) _mm256_storeu_ps(acc + g * HD + c0 + 8 * c, a[g][c]);
  }
}
#endif

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

// float32 values rounded to float16 (nearest even, as torch's .to(torch.float16)): a new
// key or value written into a float16 pool
inline void to_half(c10::Half* dst, const float* src, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

// Whether the AVX2 path reads pools of P: float32, bf16, and float16 where F16C widens it.
template <typename P>
constexpr bool avx2_pool() {
#ifdef TOKENFLEET_F16_WIDEN
  if constexpr (std::is_same_v<P, c10::Half>) return true;
#endif
  return std::is_same_v<P, float> || std::is_same_v<P, c10::BFloat16>;
}

// T: the query's, the output's and the new keys' dtype; P: the pool's (T, or float16
// under a float32 T). A new key of another dtype than the pool's is rounded to P first:
// the row attends to it as later ticks will read it from the pool.
template <typename T, typename P, int64_t HD>
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
  constexpr bool same = std::is_same_v<T, P>;
  const T* qp = q.data_ptr<T>();
  const P* kb = k_pool.data_ptr<P>() + layer * S * KVH * hd;
  const P* vb = v_pool.data_ptr<P>() + layer * S * KVH * hd;
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
  // Row b's context: each key's offset in the pool at KV head kh (-1: the new key, not
  // in the pool), worked out once per job by walking the block table (the K and V passes
  // and their prefetches ask for every row about four times; a division by the block
  // size each time cost more than the arithmetic on the row). Returns its length.
  auto context = [&](int64_t b, int64_t kh, std::vector<int64_t>& where) -> int64_t {
    const int64_t n = pp[b];
    // the query sits at position n when its own key is given (not in the pool yet),
    // else at n - 1 (its key is the pool's last)
    const int64_t at = kn ? n : n - 1;
    const int64_t first = window > 0 ? std::max<int64_t>(0, at - window + 1) : 0;
    const int64_t L = n - first + (kn ? 1 : 0);
    where.resize(std::max<int64_t>(L, 1));
    int64_t blk = first / block_size, in = first % block_size;
    for (int64_t j = 0; j < L; ++j) {
      where[j] = first + j == n ? -1 : ((tp[b * W + blk] * block_size + in) * KVH + kh) * hd;
      if (++in == block_size) in = 0, ++blk;
    }
    return L;
  };
  at::parallel_for(0, B * KVH, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * hd), acc(G * hd), row(hd), scores, total(G);
    std::vector<P> fresh_k(same ? 0 : hd), fresh_v(same ? 0 : hd);  // a new key/value as P
    std::vector<int64_t> where;  // each context row's offset in the pool (-1: the new one)
    // The next row's context, asked for (K and V of every head, to L2) a few keys at a
    // time while this row is worked on: `pump` runs every 16 keys of each K and V pass,
    // `per` keys each, so the next row's reads are spread over this row's arithmetic
    // instead of each row's first pass waiting on memory alone. On an EPYC Zen 4, where
    // a busy tick's pool comes from memory, 8 rows of 160-512 keys took 19-24 % less time,
    // bf16 and float32 (bench/paged_attention.py, interleaved pairs); a thread's first row
    // still starts cold.
    std::vector<int64_t> next;
    size_t next_at = 0, per = 0;
    auto pump = [&] {
      for (const size_t stop = std::min(next.size(), next_at + per); next_at < stop; ++next_at) {
        if (next[next_at] < 0) continue;  // the new key, not in the pool
        const char* kc = reinterpret_cast<const char*>(kb + next[next_at]);
        const char* vc = reinterpret_cast<const char*>(vb + next[next_at]);
        for (int64_t o = 0; o < KVH * hd * static_cast<int64_t>(sizeof(P)); o += 64) {
          __builtin_prefetch(kc + o, 0, 2);  // prefetcht1
          __builtin_prefetch(vc + o, 0, 2);
        }
      }
    };
    for (int64_t job = begin; job < end; ++job) {
      const int64_t b = job / KVH, kh = job % KVH;
      // A context row holds every KV head's key side by side (KVH * hd values). Where
      // this thread does all of row b's heads, its first job there asks ahead for the
      // rows of every head, keys to L1 and values to L2: the later jobs find them in the
      // cache instead of each missing on its own part of the same lines. On an EPYC
      // Zen 4, where a busy tick's pool comes from memory (the weights stream through
      // its 32 MB L3 between layers), 8 rows of 300-512 keys took 6-13 % less time
      // (bench/paged_attention.py). A row split between the threads (one row: 3 heads
      // on 2 threads) keeps one head's prefetch: there the wider one was 5-15 % slower.
      const int64_t heads_ahead = kh == 0 && end - job >= KVH ? KVH : 0;
      const int64_t L = context(b, kh, where);
      scores.assign(G * std::max<int64_t>(L, 1), 0.0f);
#ifdef TOKENFLEET_BF16_DOT
      constexpr bool fast = same && std::is_same_v<T, c10::BFloat16> && HD > 0 && HD % 32 == 0;
#else
      constexpr bool fast = false;
#endif
#ifdef TOKENFLEET_AVX2_ATTN
      constexpr bool avx2 = !fast && HD > 0 && HD % 32 == 0 && avx2_pool<P>();
#else
      constexpr bool avx2 = false;
#endif
      // a new row: ask for the next one while on it, if this thread does it whole (the
      // fast and AVX2 passes call the pump; the plain loops do not)
      if (kh == 0 && (fast || avx2)) {
        next.clear();
        next_at = 0;
        if (end - job >= 2 * KVH) {
          context(b + 1, 0, next);
          const int64_t calls = 2 * KVH * ((L + 15) / 16);  // pumps over this row's passes
          per = (next.size() + calls - 1) / std::max<int64_t>(calls, 1);
        }
      }
      // this row's own new key and value (when given), as the pool holds them
      const P* kf = nullptr;
      const P* vf = nullptr;
      if (kn) {
        const int64_t at = (b * KVH + kh) * hd;
        if constexpr (same) {
          kf = kn + at;
          vf = vn + at;
        } else {
          for (int64_t d = 0; d < hd; ++d) {
            fresh_k[d] = static_cast<P>(static_cast<float>(kn[at + d]));
            fresh_v[d] = static_cast<P>(static_cast<float>(vn[at + d]));
          }
          kf = fresh_k.data();
          vf = fresh_v.data();
        }
      }
      // key / value row j: from the pool, or (the last one, when given) its own new one
      auto row_of = [&](const P* pool, const P* fresh, int64_t j) -> const P* {
        const int64_t o = where[j];
        return o < 0 ? fresh : pool + o;
      };

      if constexpr (fast) {
#ifdef TOKENFLEET_BF16_DOT
        const auto* q16 = reinterpret_cast<const uint16_t*>(qp + (b * H + kh * G) * hd);
        int64_t j = 0;
        for (; j + 16 <= L; j += 16) {  // whole groups of 16 keys
          const uint16_t* k16[16];
          for (int i = 0; i < 16; ++i)
            k16[i] = reinterpret_cast<const uint16_t*>(row_of(kb, kf, j + i));
          if (heads_ahead > 1) {  // the next group's keys of all this thread's heads, values to L2
            for (int64_t i = j + 16; i < std::min(L, j + 32); ++i) {
              if (where[i] < 0) continue;  // the new key, not in the pool
              const char* kc = reinterpret_cast<const char*>(kb + where[i]);
              const char* vc = reinterpret_cast<const char*>(vb + where[i]);
              for (int64_t o = 0; o < heads_ahead * HD * 2; o += 64) {
                _mm_prefetch(kc + o, _MM_HINT_T0);
                _mm_prefetch(vc + o, _MM_HINT_T1);
              }
            }
          } else {
            for (int64_t i = j + 16; i < std::min(L, j + 32); ++i)  // the next group's keys
              prefetch_row<HD>(row_of(kb, kf, i));
          }
          pump();
          for (int64_t g = 0; g < G; ++g)
            dot16_bf16<HD>(q16 + g * HD, k16, scale, scores.data() + g * L + j);
        }
        for (; j < L; ++j) {  // the rest one by one
          const auto* k16 = reinterpret_cast<const uint16_t*>(row_of(kb, kf, j));
          for (int64_t g = 0; g < G; ++g)
            scores[g * L + j] = dot_bf16<HD>(q16 + g * HD, k16) * scale;
        }
#endif
      } else if constexpr (avx2) {
#ifdef TOKENFLEET_AVX2_ATTN
        to_float(qp + (b * H + kh * G) * hd, qf.data(), G * hd);
        for (int64_t i = 0; i < G * hd; ++i) qf[i] *= scale;
        int64_t j = 0;
        for (; j + 8 <= L; j += 8) {  // whole groups of 8 keys
          const P* k8[8];
          for (int i = 0; i < 8; ++i) k8[i] = row_of(kb, kf, j + i);
          for (int64_t i = j + 8; i < std::min(L, j + 16); ++i)  // the next group's keys
            prefetch_row8<HD>(row_of(kb, kf, i));
          if (j % 16 == 0) pump();
          for (int64_t g = 0; g < G; ++g)
            _mm256_storeu_ps(scores.data() + g * L + j, dot8<HD>(qf.data() + g * HD, k8));
        }
        for (; j < L; ++j) {  // the rest one by one
          const P* k1 = row_of(kb, kf, j);
          for (int64_t g = 0; g < G; ++g) scores[g * L + j] = dot1<HD>(qf.data() + g * HD, k1);
        }
#endif
      } else {
        to_float(qp + (b * H + kh * G) * hd, qf.data(), G * hd);
        for (int64_t i = 0; i < G * hd; ++i) qf[i] *= scale;
        for (int64_t j = 0; j < L; ++j) {
          to_float(row_of(kb, kf, j), row.data(), hd);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * hd;
            float s = 0.0f;
            for (int64_t d = 0; d < hd; ++d) s += qg[d] * row[d];
            scores[g * L + j] = s;
          }
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
      if constexpr (fast) {
#ifdef TOKENFLEET_BF16_DOT
        auto v16 = [&](int64_t j) {
          return reinterpret_cast<const uint16_t*>(row_of(vb, vf, j));
        };
        for (int64_t g = 0; g < G; g += 4) {  // up to 4 query heads per pass over V
          const float* w = scores.data() + g * L;
          float* a = acc.data() + g * hd;
          switch (std::min<int64_t>(4, G - g)) {
            case 1: weigh_values<HD, 1>(w, L, v16, a, pump); break;
            case 2: weigh_values<HD, 2>(w, L, v16, a, pump); break;
            case 3: weigh_values<HD, 3>(w, L, v16, a, pump); break;
            default: weigh_values<HD, 4>(w, L, v16, a, pump);
          }
        }
#endif
      } else if constexpr (avx2) {
#ifdef TOKENFLEET_AVX2_ATTN
        auto vrow = [&](int64_t j) { return row_of(vb, vf, j); };
        for (int64_t g = 0; g < G; g += 4) {  // up to 4 query heads per pass over V
          const float* w = scores.data() + g * L;
          float* a = acc.data() + g * hd;
          switch (std::min<int64_t>(4, G - g)) {
            case 1: weigh_values8<HD, 1, P>(w, L, vrow, a, pump); break;
            case 2: weigh_values8<HD, 2, P>(w, L, vrow, a, pump); break;
            case 3: weigh_values8<HD, 3, P>(w, L, vrow, a, pump); break;
            default: weigh_values8<HD, 4, P>(w, L, vrow, a, pump);
          }
        }
#endif
      } else {
        for (int64_t j = 0; j < L; ++j) {
          to_float(row_of(vb, vf, j), row.data(), hd);
          for (int64_t g = 0; g < G; ++g) {
            const float w = scores[g * L + j];
            float* ag = acc.data() + g * hd;
            for (int64_t d = 0; d < hd; ++d) ag[d] += w * row[d];
          }
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

// decode_attention_impl for q's head size: a compile-time constant for the common ones
template <typename T, typename P = T>
void decode_attention_for(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                          const c10::optional<at::Tensor>& k_new,
                          const c10::optional<at::Tensor>& v_new, const at::Tensor& tables,
                          const at::Tensor& past, int64_t layer, int64_t block_size,
                          int64_t window, at::Tensor& out) {
  auto run = [&](auto hd) {
    decode_attention_impl<T, P, decltype(hd)::value>(q, k_pool, v_pool, k_new, v_new, tables, past,
                                                  layer, block_size, window, out);
  };
  switch (q.size(2)) {
    case 64: run(std::integral_constant<int64_t, 64>{}); break;
    case 128: run(std::integral_constant<int64_t, 128>{}); break;
    case 256: run(std::integral_constant<int64_t, 256>{}); break;
    default: run(std::integral_constant<int64_t, 0>{});
  }
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
  const auto pool = k_pool.scalar_type();
  TORCH_CHECK(v_pool.scalar_type() == pool, "k_pool and v_pool in one dtype");
  TORCH_CHECK(!kc || kc->scalar_type() == q.scalar_type(), "k_new and v_new in q's dtype");
  auto out = at::empty_like(qc);
  if (pool != q.scalar_type()) {  // a float16 pool under a float32 query
    TORCH_CHECK(q.scalar_type() == at::kFloat && pool == at::kHalf,
                "the pools are in q's dtype, or float16 under a float32 q (q ",
                q.scalar_type(), ", pools ", pool, ")");
    decode_attention_for<float, c10::Half>(qc, k_pool, v_pool, kc, vc, tc, pc, layer, block_size,
                                           window, out);
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_attention",
                                  [&] {
                                    decode_attention_for<scalar_t>(qc, k_pool, v_pool, kc, vc,
                                                                   tc, pc, layer, block_size,
                                                                   window, out);
                                  });
  return out;
}

// ---- int8 / int4 weights times int8-quantized activations ----------------------------
//
// int8_linear: y[m, n] = scale[n] * sum over blocks b of 32 inputs:
//     dx[m, b] * (qx[m, b, :] . w[n, b, :])
// where qx = round(x / dx) (nearest, ties to even), dx = max |x| / 127 over the block, so
// qx lies in [-127, 127]: llama.cpp's Q8_0 x Q8_0 dot product, with the weight's one
// scale per output row. The weights are laid out for 16 outputs at a time: per group g
// of 16 rows and step s of 4 inputs, 64 bytes, lane j holding row 16g + j's inputs
// 4s..4s+3.
//
// q4_linear: y[m, n] = sum over blocks b of 32 inputs:
//     dx[m, b] * (d[n, b] * (qx[m, b, :] . q[n, b, :]) + mw[n, b] * sum(qx[m, b, :]))
// with w = q * d + mw (q in [0, 15]): llama.cpp's Q4_1 x Q8_1 dot product. Per group g of
// 16 output rows and block b, four 64-byte steps c, lane j of a step (bytes 4j..4j+3)
// holding row 16g + j's inputs 32b + 8c + i in the low nibbles of its bytes i and 32b +
// 8c + 4 + i in the high ones. d and mw are float16 [N / 16, K / 32, 16].
//
// In both layouts one instruction multiplies four inputs of many output rows by the same
// four activation bytes (broadcast), and a block's sums for those rows land in one
// register, scaled there at once: the float work is per block and 16 outputs, not per
// weight. The same arithmetic has two implementations:
// - AVX512-VNNI (Zen 4/5, Xeons since Ice Lake): vpdpbusd over all 16 rows. It takes one
//   unsigned operand: int8's activations go in as qx + 128, and 128 times the weights'
//   block sum (one more vpdpbusd per step, shared by all rows) is taken off.
// - AVX2 (Zen 2/3, Intel since Haswell): 8 rows per register, vpmaddubsw (unsigned x
//   signed bytes, pairs summed in int16) then vpmaddwd by ones (to int32). int4's
//   nibbles are the unsigned operand, and a block's products fit int16 (at most
//   8 x 2 x 15 x 127 = 30480); int8 goes in as |qx| times w carrying qx's sign (vpsignb,
//   at most 2 x 127 x 127 a pair), widened to int32 every step.
// The integer sums are exact and the float steps after them the same, in the same order,
// so both give the same bits. x is bf16 or float32, y in x's dtype (or, inside this
// file, float32 holding the bf16-rounded values: the stack's LM head). A row's arithmetic is
// lane-wise and in one order whatever the other rows, so its result does not depend on
// them or on the thread split, at any row count.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(TOKENFLEET_BF16_DOT)
#define TOKENFLEET_VNNI 1
#define TOKENFLEET_INT_KERNELS 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENFLEET_INT_AVX2 1
#define TOKENFLEET_INT_KERNELS 1
#endif

#ifdef TOKENFLEET_INT_KERNELS
// An output written as float32 holding bf16-rounded values: what a bf16 result's .float()
// holds, in one store (the LM head's logits, which sampling reads as float32).
struct Bf16InF32 {
  float f;
};

struct QRows {  // the activations, quantized per block of 32
  std::vector<int8_t> qx;  // [M, K]
  std::vector<float> dx;   // [M, K / 32]
  std::vector<float> sx;   // [M, K / 32]: dx * sum(qx), int4's offset term
};

inline int32_t four_bytes(const void* p) {  // 4 activation bytes as one broadcastable int
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// How far ahead (bytes) a group's weight stream is asked for, a block at a time: the
// weights of a tick come from memory (SmolLM2's int4 layers 66 MB, its int8 head 28 MB,
// against an L3 of 32 MB at most). Which tiles ask: each kernel family's comment below.
constexpr int64_t kWeightsAhead = 2048;
#endif

#ifdef TOKENFLEET_VNNI
// How far ahead the weight stream is asked for (kWeightsAhead, above) on AVX-512: on an
// EPYC Zen 4 (bench/int_kernels.py, checkouts interleaved), int4 took 13-22 % less time
// at 4-8 rows and the same at one (7-10 % less in process, the distance switched between
// rounds; 2048 and 4096 bytes alike, 512 no gain); int8 took 5-18 % less at 4-8 rows but
// 10 % more at one row, where its plain stream already reads ~25 GB/s, so int8 asks ahead
// in its 4- and 8-row tiles only. The tiles are kept out of line, as on AVX2 (below): gcc
// kept the 4- and 8-row ones out of line on its own and inlined the 1- and 2-row ones;
// all out of line read the same on a Zen 4 (the fastest of 7 rounds 0-6 % quicker at one
// and two rows, medians within the host's noise; three interleaved sets).

inline __m512 load16(const c10::BFloat16* p) {  // bf16
  return widen16(reinterpret_cast<const uint16_t*>(p));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

// One block of 32 activations quantized: the 32 qx to dst, their sum to qsum; returns d.
template <typename S>
inline float quantize_block32(const S* src, int8_t* dst, int32_t& qsum) {
  const __m512 f0 = load16(src), f1 = load16(src + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(f0), _mm512_abs_ps(f1)));
  const float d = amax / 127.0f;
  const __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  const __m512i hi = _mm512_set1_epi32(127), lo = _mm512_set1_epi32(-127);
  const __m512i q0 =
      _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(f0, inv)), hi), lo);
  const __m512i q1 =
      _mm512_max_epi32(_mm512_min_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(f1, inv)), hi), lo);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm512_cvtepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 16), _mm512_cvtepi32_epi8(q1));
  qsum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  return d;
}

inline void store16(c10::BFloat16* out, __m512 v, int64_t live) {  // bf16, nearest even
  const __mmask16 keep = live >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << live) - 1);
  _mm256_mask_storeu_epi16(out, keep, (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(float* out, __m512 v, int64_t live) {
  const __mmask16 keep = live >= 16 ? __mmask16(0xFFFF) : static_cast<__mmask16>((1u << live) - 1);
  _mm512_mask_storeu_ps(out, keep, v);
}
inline void store16(Bf16InF32* out, __m512 v, int64_t live) {  // rounded to bf16, kept float32
  store16(reinterpret_cast<float*>(out), round16(v), live);
}

template <int MR, typename O>
[[gnu::noinline]] void q8_group(const QRows& q, int64_t m0, const int8_t* w, const float* ws,
                                int64_t g, int64_t K, int64_t N, O* out) {
  const int64_t B = K / 32;
  const int8_t* wg = w + g * 16 * K;
  const __m512i half = _mm512_set1_epi8(static_cast<char>(0x80));
  const int32_t flip = static_cast<int32_t>(0x80808080u);  // qx ^ 0x80 = qx + 128, unsigned
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i isum[MR];
    __m512i corr = _mm512_setzero_si512();
    for (int r = 0; r < MR; ++r) isum[r] = _mm512_setzero_si512();
    if constexpr (MR >= 4) {  // (runs past the group's end into the next one: harmless)
      const char* ahead = reinterpret_cast<const char*>(wg + b * 512) + kWeightsAhead;
      for (int c = 0; c < 8; ++c) _mm_prefetch(ahead + c * 64, _MM_HINT_T0);
    }
    for (int c = 0; c < 8; ++c) {
      const __m512i v = _mm512_loadu_si512(wg + (b * 8 + c) * 64);
      corr = _mm512_dpbusd_epi32(corr, half, v);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = q.qx.data() + (m0 + r) * K + b * 32 + c * 4;
        isum[r] = _mm512_dpbusd_epi32(isum[r], _mm512_set1_epi32(four_bytes(xr) ^ flip), v);
      }
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(isum[r], corr));
      acc[r] = _mm512_fmadd_ps(dot, _mm512_set1_ps(q.dx[(m0 + r) * B + b]), acc[r]);
    }
  }
  const __m512 scale = _mm512_loadu_ps(ws + g * 16);
  const int64_t live = N - g * 16;  // the last group may be short
  for (int r = 0; r < MR; ++r) store16(out + (m0 + r) * N + g * 16, _mm512_mul_ps(acc[r], scale), live);
}

template <int MR, typename O>
[[gnu::noinline]] void q4_group(const QRows& q, int64_t m0, const uint8_t* w, const at::Half* d,
                                const at::Half* mw, int64_t g, int64_t K, int64_t N, O* out) {
  const int64_t B = K / 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const uint8_t* wg = w + g * B * 256;
  const uint16_t* dg = reinterpret_cast<const uint16_t*>(d) + g * B * 16;
  const uint16_t* mg = reinterpret_cast<const uint16_t*>(mw) + g * B * 16;
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    __m512i isum[MR];
    for (int r = 0; r < MR; ++r) isum[r] = _mm512_setzero_si512();
    {
      const char* ahead = reinterpret_cast<const char*>(wg + b * 256) + kWeightsAhead;
      for (int c = 0; c < 4; ++c) _mm_prefetch(ahead + c * 64, _MM_HINT_T0);
    }
    for (int c = 0; c < 4; ++c) {
      const __m512i v = _mm512_loadu_si512(wg + (b * 4 + c) * 64);
      const __m512i lo = _mm512_and_si512(v, nibble);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
      for (int r = 0; r < MR; ++r) {
        const int8_t* xr = q.qx.data() + (m0 + r) * K + b * 32 + c * 8;
        isum[r] = _mm512_dpbusd_epi32(isum[r], lo, _mm512_set1_epi32(four_bytes(xr)));
        isum[r] = _mm512_dpbusd_epi32(isum[r], hi, _mm512_set1_epi32(four_bytes(xr + 4)));
      }
    }
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dg + b * 16)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mg + b * 16)));
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (m0 + r) * B + b;
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(q.dx[at]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), scale, acc[r]);
      acc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(q.sx[at]), acc[r]);
    }
  }
  const int64_t live = N - g * 16;  // the last group may be short
  for (int r = 0; r < MR; ++r) store16(out + (m0 + r) * N + g * 16, acc[r], live);
}
#endif  // TOKENFLEET_VNNI

#ifdef TOKENFLEET_INT_AVX2
template <typename S>
inline float quantize_block32(const S* src, int8_t* dst, int32_t& qsum) {  // as above
  __m256 f[4];
  for (int i = 0; i < 4; ++i) f[i] = widen8(src + 8 * i);  // (the attention section's)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign, f[0]), _mm256_andnot_ps(sign, f[1]));
  m = _mm256_max_ps(m, _mm256_max_ps(_mm256_andnot_ps(sign, f[2]), _mm256_andnot_ps(sign, f[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.0f;
  const __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
  const __m256i hi = _mm256_set1_epi32(127), lo = _mm256_set1_epi32(-127);
  __m256i q[4];
  for (int i = 0; i < 4; ++i)
    q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(f[i], inv)), hi), lo);
  const __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  qsum = _mm_cvtsi128_si32(s4);
  // packing works within 128-bit lanes: 4-byte groups come out as q0 0-3, q1 0-3, q2 0-3,
  // q3 0-3, q0 4-7, ...; the permute puts them back in order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), ordered);
  return d;
}

inline void store8(float* out, __m256 v, int64_t live) {
  if (live >= 8) {
    _mm256_storeu_ps(out, v);
  } else {
    alignas(32) float t[8];
    _mm256_store_ps(t, v);
    std::memcpy(out, t, live * sizeof(float));
  }
}
inline __m256i bf16_bits8(__m256 v) {  // 8 floats to bf16 (nearest even), in 32-bit lanes
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}
inline void store8(Bf16InF32* out, __m256 v, int64_t live) {  // rounded to bf16, kept float32
  store8(reinterpret_cast<float*>(out), _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)), live);
}
inline void store8(c10::BFloat16* out, __m256 v, int64_t live) {  // bf16, nearest even
  const __m256i r = bf16_bits8(v);
  const __m128i h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  if (live >= 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
  } else {
    alignas(16) uint16_t t[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(t), h);
    std::memcpy(out, t, live * sizeof(uint16_t));
  }
}

// AVX2 has 16 vector registers: a group's 16 outputs are two halves of 8, each the
// 32-byte half of every 64-byte weight step. At one or two rows both halves go in one
// pass, which also asks for the weight stream kWeightsAhead bytes ahead; at four rows the
// sums would not fit the registers, so each half is a pass of its own (the second finds
// the group's weights in L1/L2) and nothing is asked ahead (it read no faster). Kept out
// of line: inlined into the thread loop beside the one-pass tiles, the four-row tile ran
// 18-48 % slower. On an EPYC Zen 3 (bench/int_kernels.py, checkouts interleaved) one row
// took 10-20 % less time than two passes (int4 and int8), four and eight rows the same.

template <int MR>
constexpr int halves_per_pass() {
  return MR <= 2 ? 2 : 1;
}

template <int MR, typename O>
[[gnu::noinline]] void q8_group(const QRows& q, int64_t m0, const int8_t* w, const float* ws,
                                int64_t g, int64_t K, int64_t N, O* out) {
  constexpr int HP = halves_per_pass<MR>();
  const int64_t B = K / 32;
  const int8_t* wg = w + g * 16 * K;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int h0 = 0; h0 < 2; h0 += HP) {
    if (N - g * 16 - h0 * 8 <= 0) break;  // (the rows past N are padding: safe to read)
    __m256 acc[MR][HP];
    for (int r = 0; r < MR; ++r)
      for (int hh = 0; hh < HP; ++hh) acc[r][hh] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      __m256i isum[MR][HP];
      for (int r = 0; r < MR; ++r)
        for (int hh = 0; hh < HP; ++hh) isum[r][hh] = _mm256_setzero_si256();
      if constexpr (HP == 2) {  // (runs past the group's end into the next one: harmless)
        const char* ahead = reinterpret_cast<const char*>(wg + b * 512) + kWeightsAhead;
        for (int c = 0; c < 8; ++c) _mm_prefetch(ahead + c * 64, _MM_HINT_T0);
      }
      for (int c = 0; c < 8; ++c) {
        __m256i v[HP];
        for (int hh = 0; hh < HP; ++hh)
          v[hh] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (b * 8 + c) * 64 + (h0 + hh) * 32));
        for (int r = 0; r < MR; ++r) {
          const __m256i x = _mm256_set1_epi32(four_bytes(q.qx.data() + (m0 + r) * K + b * 32 + c * 4));
          const __m256i ax = _mm256_sign_epi8(x, x);
          for (int hh = 0; hh < HP; ++hh) {
            const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(v[hh], x));
            isum[r][hh] = _mm256_add_epi32(isum[r][hh], _mm256_madd_epi16(p, ones));
          }
        }
      }
      for (int r = 0; r < MR; ++r) {
        const __m256 dx = _mm256_set1_ps(q.dx[(m0 + r) * B + b]);
        for (int hh = 0; hh < HP; ++hh)
          acc[r][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][hh]), dx, acc[r][hh]);
      }
    }
    for (int hh = 0; hh < HP; ++hh) {
      const int64_t live = std::min<int64_t>(8, N - g * 16 - (h0 + hh) * 8);
      if (live <= 0) break;
      const __m256 scale = _mm256_loadu_ps(ws + g * 16 + (h0 + hh) * 8);
      for (int r = 0; r < MR; ++r)
        store8(out + (m0 + r) * N + g * 16 + (h0 + hh) * 8, _mm256_mul_ps(acc[r][hh], scale), live);
    }
  }
}

template <int MR, typename O>
[[gnu::noinline]] void q4_group(const QRows& q, int64_t m0, const uint8_t* w, const at::Half* d,
                                const at::Half* mw, int64_t g, int64_t K, int64_t N, O* out) {
  constexpr int HP = halves_per_pass<MR>();
  const int64_t B = K / 32;
  const __m256i nibble = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const uint8_t* wg = w + g * B * 256;
  const uint16_t* dg = reinterpret_cast<const uint16_t*>(d) + g * B * 16;
  const uint16_t* mg = reinterpret_cast<const uint16_t*>(mw) + g * B * 16;
  for (int h0 = 0; h0 < 2; h0 += HP) {
    if (N - g * 16 - h0 * 8 <= 0) break;  // (the rows past N are padding: safe to read)
    __m256 acc[MR][HP];
    for (int r = 0; r < MR; ++r)
      for (int hh = 0; hh < HP; ++hh) acc[r][hh] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      __m256i s16[MR][HP];  // a block's products in int16 (module comment)
      for (int r = 0; r < MR; ++r)
        for (int hh = 0; hh < HP; ++hh) s16[r][hh] = _mm256_setzero_si256();
      if constexpr (HP == 2) {
        const char* ahead = reinterpret_cast<const char*>(wg + b * 256) + kWeightsAhead;
        for (int c = 0; c < 4; ++c) _mm_prefetch(ahead + c * 64, _MM_HINT_T0);
      }
      for (int c = 0; c < 4; ++c) {
        __m256i lo[HP], hi[HP];
        for (int hh = 0; hh < HP; ++hh) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + (b * 4 + c) * 64 + (h0 + hh) * 32));
          lo[hh] = _mm256_and_si256(v, nibble);
          hi[hh] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
        }
        for (int r = 0; r < MR; ++r) {
          const int8_t* xr = q.qx.data() + (m0 + r) * K + b * 32 + c * 8;
          const __m256i x0 = _mm256_set1_epi32(four_bytes(xr)), x1 = _mm256_set1_epi32(four_bytes(xr + 4));
          for (int hh = 0; hh < HP; ++hh) {
            s16[r][hh] = _mm256_add_epi16(s16[r][hh], _mm256_maddubs_epi16(lo[hh], x0));
            s16[r][hh] = _mm256_add_epi16(s16[r][hh], _mm256_maddubs_epi16(hi[hh], x1));
          }
        }
      }
      for (int hh = 0; hh < HP; ++hh) {
        const int64_t at8 = b * 16 + (h0 + hh) * 8;
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(dg + at8)));
        const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mg + at8)));
        for (int r = 0; r < MR; ++r) {
          const int64_t at = (m0 + r) * B + b;
          const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(q.dx[at]));
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16[r][hh], ones));
          acc[r][hh] = _mm256_fmadd_ps(dot, scale, acc[r][hh]);
          acc[r][hh] = _mm256_fmadd_ps(mv, _mm256_set1_ps(q.sx[at]), acc[r][hh]);
        }
      }
    }
    for (int hh = 0; hh < HP; ++hh) {
      const int64_t live = std::min<int64_t>(8, N - g * 16 - (h0 + hh) * 8);
      if (live <= 0) break;
      for (int r = 0; r < MR; ++r)
        store8(out + (m0 + r) * N + g * 16 + (h0 + hh) * 8, acc[r][hh], live);
    }
  }
}
#endif  // TOKENFLEET_INT_AVX2

#ifdef TOKENFLEET_INT_KERNELS
template <typename S>
inline void quantize_rows(const S* x, int64_t M, int64_t K, QRows& q) {
  const int64_t B = K / 32;
  q.qx.resize(M * K);
  q.dx.resize(M * B);
  q.sx.resize(M * B);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < B; ++b) {
      int32_t sum;
      const float d = quantize_block32(x + m * K + b * 32, q.qx.data() + m * K + b * 32, sum);
      q.dx[m * B + b] = d;
      q.sx[m * B + b] = d * static_cast<float>(sum);
    }
  }
}

// The rows of x in tiles (8, 4, 2 and 1 rows on AVX-512; 4, 2, 1 on AVX2), every group
// of 16 outputs shared among the threads. T: x's and y's element type.
template <typename T, typename O, typename Group>
void int_matmul_as(const at::Tensor& x, at::Tensor& out, int64_t groups, Group group) {
  const int64_t M = x.size(0), K = x.size(1);
  QRows q;
  quantize_rows(x.data_ptr<T>(), M, K, q);
  O* op = reinterpret_cast<O*>(out.data_ptr());
  at::parallel_for(0, groups, 4, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      int64_t m = 0;
#ifdef TOKENFLEET_VNNI
      for (; m + 8 <= M; m += 8) group(std::integral_constant<int, 8>(), q, m, g, op);
#endif
      for (; m + 4 <= M; m += 4) group(std::integral_constant<int, 4>(), q, m, g, op);
      for (; m + 2 <= M; m += 2) group(std::integral_constant<int, 2>(), q, m, g, op);
      for (; m < M; ++m) group(std::integral_constant<int, 1>(), q, m, g, op);
    }
  });
}

// out in x's dtype, or float32 for a bf16 x (the values rounded to bf16 all the same)
template <typename Group>
void int_matmul(const at::Tensor& x, at::Tensor& out, int64_t groups, Group group) {
  if (x.scalar_type() == at::kFloat)
    int_matmul_as<float, float>(x, out, groups, group);
  else if (out.scalar_type() == at::kFloat)
    int_matmul_as<c10::BFloat16, Bf16InF32>(x, out, groups, group);
  else
    int_matmul_as<c10::BFloat16, c10::BFloat16>(x, out, groups, group);
}
#endif

// the kernels write out's rows without bounds: [M, N], contiguous, x's dtype or float32
inline void check_out(const at::Tensor& x, const at::Tensor& out, int64_t N, const char* op) {
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == N &&
                  out.is_contiguous() &&
                  (out.scalar_type() == x.scalar_type() || out.scalar_type() == at::kFloat),
              op, ": out [M, N], contiguous, in x's dtype or float32");
}

// x's rows times w into out ([M, N], x's dtype, or float32 for a bf16 x: module comment)
void int8_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                      int64_t N, at::Tensor& out);
void q4_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dm, int64_t N,
                    at::Tensor& out);

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                       int64_t N) {
  auto out = at::empty({x.dim() == 2 ? x.size(0) : 0, N}, x.options());
  int8_linear_into(x, w, scales, N, out);
  return out;
}

at::Tensor q4_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dm, int64_t N) {
  auto out = at::empty({x.dim() == 2 ? x.size(0) : 0, N}, x.options());
  q4_linear_into(x, w, dm, N, out);
  return out;
}

void int8_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                      int64_t N, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && scales.dim() == 1,
              "x [M, K], w [N rounded up to 16, K], scales [N rounded up to 16]");
  const int64_t M = x.size(0), K = x.size(1), R = w.size(0);
  TORCH_CHECK(K % 32 == 0 && w.size(1) == K && R % 16 == 0 && scales.size(0) == R &&
                  N > R - 16 && N <= R,
              "int8_linear: shapes do not match");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  w.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "int8_linear: x bf16 or float32, w int8, scales float32");
  check_out(x, out, N, "int8_linear");
  if (M == 0) return;
#ifdef TOKENFLEET_INT_KERNELS
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto sc = scales.contiguous();
  const int8_t* wp = wc.data_ptr<int8_t>();
  const float* sp = sc.data_ptr<float>();
  auto group = [&](auto mr, const QRows& q, int64_t m, int64_t g, auto* op) {
    q8_group<decltype(mr)::value>(q, m, wp, sp, g, K, N, op);
  };
  int_matmul(xc, out, R / 16, group);
#else
  TORCH_CHECK(false, "int8_linear needs AVX2 or AVX512-VNNI (tokenfleet::int_kernels() is empty here)");
#endif
}

void q4_linear_into(const at::Tensor& x, const at::Tensor& w, const at::Tensor& dm, int64_t N,
                    at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && dm.dim() == 4 && dm.size(0) == 2 && dm.size(3) == 16,
              "x [M, K], w [N rounded up to 16, K / 2], dm [2, N rounded up / 16, K / 32, 16]");
  const int64_t M = x.size(0), K = x.size(1), G = dm.size(1);
  TORCH_CHECK(K % 32 == 0 && w.size(1) * 2 == K && w.size(0) == G * 16 && dm.size(2) * 32 == K &&
                  N > (G - 1) * 16 && N <= G * 16,
              "q4_linear: shapes do not match");
  TORCH_CHECK((x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) &&
                  w.scalar_type() == at::kByte && dm.scalar_type() == at::kHalf,
              "q4_linear: x bf16 or float32, w uint8, dm float16");
  check_out(x, out, N, "q4_linear");
  if (M == 0) return;
#ifdef TOKENFLEET_INT_KERNELS
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto dc = dm.contiguous();
  const uint8_t* wp = wc.data_ptr<uint8_t>();
  const at::Half* dp = dc.data_ptr<at::Half>();
  const at::Half* mp = dp + G * (K / 32) * 16;
  auto group = [&](auto mr, const QRows& q, int64_t m, int64_t g, auto* op) {
    q4_group<decltype(mr)::value>(q, m, wp, dp, mp, g, K, N, op);
  };
  int_matmul(xc, out, G, group);
#else
  TORCH_CHECK(false, "q4_linear needs AVX2 or AVX512-VNNI (tokenfleet::int_kernels() is empty here)");
#endif
}

// ---- a decode tick's layers in one call (the native decode stack) -------------------
//
// Every layer of a tick in which each row decodes one token: norm, q/k/v, rope, the K/V
// write into the pool, the attention above, the output projection, the MLP, and the final
// norm, from one C++ loop (tokenfleet/model/native_decode.py binds the weights once). The
// compiled decode graph does the same work as ~290 calls a tick (fused loops, each extern
// kernel through the dispatcher, its guards and buffers): 0.6 ms of a one-row tick and
// 1.2 of an eight-row one on an EPYC Zen 4. Here the pointwise work runs in plain loops on
// the calling thread (a tick's rows are few) and the matmul and attention kernels are
// called directly.
//
// The arithmetic is eager PyTorch's, op by op: for a bf16 model each op computes in
// float32 from bf16 inputs and rounds its result to bf16 (nearest even), as the eager
// forward (`tokenfleet/model/layers.py`) does; a float32 model (a CPU without bf16)
// keeps float32 throughout. Only the order of a norm's sum of squares may differ from
// torch's. The two are one code, over the storage types below.

inline float bf(uint16_t h) {  // bf16 bits -> float (exact)
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t to_bf(float f) {  // float -> bf16 bits, nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float round_bf(float f) { return bf(to_bf(f)); }

// What the stack stores between ops: bf16 bits, each op's result rounded; or float32.
struct Bf16 {
  using S = uint16_t;     // as stored
  using T = c10::BFloat16;  // as torch names it
  static constexpr at::ScalarType kType = at::kBFloat16;
  static float get(S h) { return bf(h); }
  static S put(float f) { return to_bf(f); }
  static float round(float f) { return round_bf(f); }
};
struct F32 {
  using S = float;
  using T = float;
  static constexpr at::ScalarType kType = at::kFloat;
  static float get(S f) { return f; }
  static S put(float f) { return f; }
  static float round(float f) { return f; }
};

// One row of n values normalised, as layers.rms_norm: out = w * (x / rms(x)).to(dtype)
// (Llama), or with `fp32_scale` (Gemma) (x / rms(x) * w) in float32 before rounding.
// In place (out == x) is fine: each value is read before it is written.
template <typename D, typename S = typename D::S>
inline void rms_norm_row(const S* x, const S* w, int64_t n, float eps, bool fp32_scale, S* out) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += D::get(x[i]) * D::get(x[i]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (fp32_scale) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = D::put(D::get(x[i]) * r * D::get(w[i]));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = D::put(D::get(w[i]) * D::round(D::get(x[i]) * r));
  }
}

// layers.rotate on one head of hd values: x * cos + rotate_half(x) * sin
template <typename D, typename S = typename D::S>
inline void rope_head(const S* x, const S* c, const S* s, int64_t hd, S* out) {
  const int64_t half = hd / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = D::get(x[i]), x2 = D::get(x[i + half]);
    out[i] = D::put(D::round(x1 * D::get(c[i])) + D::round(-x2 * D::get(s[i])));
    out[i + half] =
        D::put(D::round(x2 * D::get(c[i + half])) + D::round(x1 * D::get(s[i + half])));
  }
}

#ifdef TOKENFLEET_BF16_DOT
// e^x for 16 floats: x = n ln2 + r (|r| <= ln2 / 2), e^r by its degree-6 Taylor
// polynomial (relative error below 2e-7, far inside bf16's rounding), times 2^n by
// vscalefps. About a third of glibc's vector expf's time: the SiLU of an 8-row tick's
// MLP was a tenth of the stack's own time with it.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-103.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);  // ln 2, split in two
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 e = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = _mm512_fmadd_ps(e, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(e, n);
}

#endif

class DecodeStack : public torch::CustomClassHolder {
 public:
  // Per layer, kPerLayer tensors (an empty tensor where the model has none): [attn norm,
  // qkv, qkv scales, qkv bias, q norm, k norm, o, o scales, o bias, attn out norm, mlp
  // norm, gate_up, gate_up scales, gate_up bias, down, down scales, down bias, mlp out
  // norm]. kinds: per layer and projection (qkv, o, gate_up, down) 0 dense [N, K] (its
  // scales empty), 1 int8 rows16, 2 int4 rows16. fp32_scale and query_scale are Gemma's
  // (layers.rms_norm's scale_fp32, LayerShape.query_scale). The model's dtype (bf16 or
  // float32) is the final norm's: every vector, dense weight, input and pool has it.
  static constexpr int64_t kPerLayer = 18;
  enum Slot : int64_t {
    kAttnNorm, kQkv, kQkvScales, kQkvBias, kQNorm, kKNorm,
    kO, kOScales, kOBias, kAttnOutNorm,
    kMlpNorm, kGateUp, kGateUpScales, kGateUpBias, kDown, kDownScales, kDownBias, kMlpOutNorm,
  };

  // embed: the token embedding [vocab, hidden] in the model dtype, embed_scale Gemma's
  // factor on it (0: none), for `decode`.
  DecodeStack(std::vector<at::Tensor> weights, std::vector<int64_t> kinds,
              std::vector<int64_t> windows, at::Tensor final_norm, at::Tensor embed,
              double embed_scale, int64_t heads, int64_t kv_heads, int64_t head_dim,
              int64_t hidden, int64_t inter, double eps, bool gelu, bool fp32_scale,
              double query_scale)
      : w_(std::move(weights)), kinds_(std::move(kinds)), windows_(std::move(windows)),
        final_norm_(std::move(final_norm)), embed_(std::move(embed)), embed_scale_(embed_scale),
        dtype_(final_norm_.scalar_type()), H_(heads), KVH_(kv_heads), hd_(head_dim),
        hidden_(hidden), inter_(inter), eps_(static_cast<float>(eps)), gelu_(gelu),
        fp32_scale_(fp32_scale), query_scale_(static_cast<float>(query_scale)) {
    const int64_t L = static_cast<int64_t>(windows_.size());
    TORCH_CHECK(static_cast<int64_t>(w_.size()) == kPerLayer * L &&
                    static_cast<int64_t>(kinds_.size()) == 4 * L,
                "DecodeStack: 18 weights and 4 kinds per layer");
    TORCH_CHECK(hd_ % 2 == 0 && H_ % KVH_ == 0, "DecodeStack: head shapes");
    for (const auto& t : w_)
      TORCH_CHECK(t.numel() == 0 || t.is_contiguous(), "DecodeStack: weights must be contiguous");
    for (int64_t k : kinds_) TORCH_CHECK(k >= 0 && k <= 2, "DecodeStack: unknown weight kind");
    TORCH_CHECK(dtype_ == at::kBFloat16 || dtype_ == at::kFloat,
                "DecodeStack: a bf16 or float32 model");
    // the loops read these without bounds: vectors of the dtype and length they assume
    auto vec_ok = [this](const at::Tensor& t, int64_t n, bool optional) {
      if (optional && t.numel() == 0) return true;
      return t.scalar_type() == dtype_ && t.dim() == 1 && t.numel() == n;
    };
    const int64_t qkv_n = (H_ + 2 * KVH_) * hd_;
    TORCH_CHECK(vec_ok(final_norm_, hidden_, false), "DecodeStack: norm weights [hidden] in the model dtype");
    TORCH_CHECK(embed_.dim() == 2 && embed_.size(1) == hidden_ && embed_.scalar_type() == dtype_ &&
                    embed_.is_contiguous(),
                "DecodeStack: the embedding [vocab, hidden] in the model dtype, contiguous");
    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = w_.data() + kPerLayer * l;
      TORCH_CHECK(vec_ok(w[kAttnNorm], hidden_, false) && vec_ok(w[kMlpNorm], hidden_, false) &&
                      vec_ok(w[kAttnOutNorm], hidden_, true) &&
                      vec_ok(w[kMlpOutNorm], hidden_, true),
                  "DecodeStack: norm weights [hidden] in the model dtype");
      TORCH_CHECK((w[kQNorm].numel() == 0) == (w[kKNorm].numel() == 0) &&
                      vec_ok(w[kQNorm], hd_, true) && vec_ok(w[kKNorm], hd_, true),
                  "DecodeStack: q/k norm weights [head_dim], both or neither");
      TORCH_CHECK(vec_ok(w[kQkvBias], qkv_n, true) && vec_ok(w[kOBias], hidden_, true) &&
                      vec_ok(w[kGateUpBias], 2 * inter_, true) &&
                      vec_ok(w[kDownBias], hidden_, true),
                  "DecodeStack: bias [out features] in the model dtype");
    }
    for (int64_t i = 0; i < static_cast<int64_t>(kinds_.size()); ++i) {
      const at::Tensor& m = w_[kPerLayer * (i / 4) + std::array<int64_t, 4>{kQkv, kO, kGateUp, kDown}[i % 4]];
      TORCH_CHECK(kinds_[i] != 0 || m.scalar_type() == dtype_,
                  "DecodeStack: dense weights in the model dtype");
    }
#ifndef TOKENFLEET_INT_KERNELS
    for (int64_t k : kinds_)
      TORCH_CHECK(k == 0, "DecodeStack: packed weights need AVX2 or AVX512-VNNI");
#endif
  }

  // x [B, hidden] (the embedded tokens); cos/sin and the sliding layers' wcos/wsin
  // [B, hd]; pools [layers, S, KVH, hd] (in the model dtype, or float16 for a float32
  // model: each new K/V rounded to it as it is written); tables [B, W] int32;
  // positions [B] int64 (each row's new token's); slots [B] int64 (where its K/V go in
  // the pools). Writes every layer's new K/V into the pools and returns the final norm's
  // output [B, hidden].
  at::Tensor run(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor wcos, at::Tensor wsin,
                 at::Tensor k_pool, at::Tensor v_pool, at::Tensor tables, at::Tensor positions,
                 at::Tensor slots, int64_t block_size) {
    if (dtype_ == at::kFloat && k_pool.scalar_type() == at::kHalf)
      return run_as<F32, c10::Half>(x, cos, sin, wcos, wsin, k_pool, v_pool, tables, positions,
                                    slots, block_size);
    if (dtype_ == at::kFloat)
      return run_as<F32, float>(x, cos, sin, wcos, wsin, k_pool, v_pool, tables, positions, slots,
                                block_size);
    return run_as<Bf16, c10::BFloat16>(x, cos, sin, wcos, wsin, k_pool, v_pool, tables, positions,
                                       slots, block_size);
  }

  // A whole decode tick from token ids to logits: each row's token embedded (times the
  // embedding scale, rounded, where the model has one), its rope row taken from the
  // tables at its position (cos/sin [P, hd], the sliding layers' wcos/wsin, in the model
  // dtype: rope.rope_cos_sin over 0 .. P - 1, the same values row by row), the layers
  // (`run`), then the LM head: kind 0 dense [vocab, hidden] in the model dtype, 1 int8
  // rows16, 2 int4 rows16 (head_scales empty when dense). Returns float32 logits
  // [B, vocab]: a bf16 model's values rounded to bf16, as its head's .float().
  at::Tensor decode(at::Tensor ids, at::Tensor cos_t, at::Tensor sin_t, at::Tensor wcos_t,
                    at::Tensor wsin_t, at::Tensor k_pool, at::Tensor v_pool, at::Tensor tables,
                    at::Tensor positions, at::Tensor slots, int64_t block_size, at::Tensor head,
                    at::Tensor head_scales, int64_t head_kind, int64_t vocab) {
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && positions.dim() == 1 &&
                    positions.scalar_type() == at::kLong && positions.size(0) == ids.size(0),
                "DecodeStack.decode: ids and positions int64 [B]");
    auto idc = ids.contiguous();
    auto pc = positions.contiguous();
    const int64_t B = idc.size(0), V = embed_.size(0);
    const int64_t* ip = idc.data_ptr<int64_t>();
    const int64_t* pp = pc.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b)
      TORCH_CHECK(ip[b] >= 0 && ip[b] < V, "DecodeStack.decode: token id ", ip[b],
                  " outside the vocabulary (", V, ")");
    for (const auto* t : {&cos_t, &sin_t, &wcos_t, &wsin_t}) {
      TORCH_CHECK(t->dim() == 2 && t->size(1) == hd_ && t->scalar_type() == dtype_,
                  "DecodeStack.decode: rope tables [P, hd] in the model dtype");
      for (int64_t b = 0; b < B; ++b)
        TORCH_CHECK(pp[b] >= 0 && pp[b] < t->size(0), "DecodeStack.decode: position ", pp[b],
                    " outside the rope table (", t->size(0), " rows)");
    }
    TORCH_CHECK(head_kind >= 0 && head_kind <= 2 && head.dim() == 2 && vocab > 0,
                "DecodeStack.decode: head kind 0 (dense), 1 (int8) or 2 (int4)");
    TORCH_CHECK(head_kind != 0 || (head.scalar_type() == dtype_ && head.size(0) == vocab &&
                                   head.size(1) == hidden_),
                "DecodeStack.decode: a dense head [vocab, hidden] in the model dtype");
    auto x = embed_.index_select(0, idc);
    if (embed_scale_ != 0.0)  // x * scale in the model dtype, as the eager forward
      x = x * at::scalar_tensor(embed_scale_, x.options());
    auto rows = [&](const at::Tensor& t) { return t.index_select(0, pc); };
    auto cos = rows(cos_t), sin = rows(sin_t);
    const bool same = wcos_t.is_same(cos_t) && wsin_t.is_same(sin_t);
    auto wcos = same ? cos : rows(wcos_t), wsin = same ? sin : rows(wsin_t);
    auto normed = run(x, cos, sin, wcos, wsin, k_pool, v_pool, tables, pc, slots, block_size);
    if (head_kind == 0) return at::linear(normed, head).to(at::kFloat);
    auto logits = at::empty({B, vocab}, normed.options().dtype(at::kFloat));
    if (head_kind == 1) {
      RECORD_FUNCTION("tokenfleet::int8_linear", std::vector<c10::IValue>());
      int8_linear_into(normed, head, head_scales, vocab, logits);
    } else {
      RECORD_FUNCTION("tokenfleet::q4_linear", std::vector<c10::IValue>());
      q4_linear_into(normed, head, head_scales, vocab, logits);
    }
    return logits;
  }

 private:
  // D: the model's storage type; P: the pool's element type (D::T, or float16 under F32)
  template <typename D, typename P>
  at::Tensor run_as(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& wcos, const at::Tensor& wsin, const at::Tensor& k_pool,
                    const at::Tensor& v_pool, const at::Tensor& tables,
                    const at::Tensor& positions, const at::Tensor& slots, int64_t block_size) {
    using E = typename D::S;  // (S is the pool's slot count)
    constexpr bool same = std::is_same_v<P, typename D::T>;
    const at::ScalarType pool = c10::CppTypeToScalarType<P>::value;
    const int64_t B = x.size(0), L = static_cast<int64_t>(windows_.size());
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == dtype_,
                "DecodeStack.run: x [B, hidden] in the model dtype");
    TORCH_CHECK(k_pool.dim() == 4 && k_pool.size(0) == L && k_pool.size(2) == KVH_ &&
                    k_pool.size(3) == hd_ && k_pool.scalar_type() == pool &&
                    k_pool.sizes() == v_pool.sizes() && v_pool.scalar_type() == pool &&
                    k_pool.is_contiguous() && v_pool.is_contiguous(),
                "DecodeStack.run: pools [layers, S, KVH, hd], contiguous, in the model dtype "
                "(or float16 for a float32 model)");
    TORCH_CHECK(positions.size(0) == B && slots.size(0) == B && tables.size(0) == B &&
                    positions.scalar_type() == at::kLong && slots.scalar_type() == at::kLong,
                "DecodeStack.run: one position, slot and table row per row");
    for (const auto* t : {&cos, &sin, &wcos, &wsin})
      TORCH_CHECK(t->dim() == 2 && t->size(0) == B && t->size(1) == hd_ &&
                      t->scalar_type() == dtype_ && t->is_contiguous(),
                  "DecodeStack.run: cos/sin [B, hd] in the model dtype");
    const int64_t S = k_pool.size(1), row = KVH_ * hd_, qn = H_ * hd_;
    const int64_t* sp = slots.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) TORCH_CHECK(sp[b] >= 0 && sp[b] < S, "DecodeStack.run: slot out of the pool");
    auto tab = tables.to(at::kInt).contiguous();  // attention reads each context through it
    const int32_t* tp = tab.data_ptr<int32_t>();
    const int64_t blocks = S / block_size;
    for (int64_t i = 0; i < tab.numel(); ++i)
      TORCH_CHECK(tp[i] >= 0 && tp[i] < blocks, "DecodeStack.run: block out of the pool");

    RECORD_FUNCTION("tokenfleet::DecodeStack.run", std::vector<c10::IValue>());
    auto h = x.clone();  // the residual stream, updated in place
    auto normed = at::empty_like(h);
    auto q = at::empty({B, H_, hd_}, x.options());
    auto act = at::empty({B, inter_}, x.options());
    auto past = positions + 1;  // each row's keys in the pool once its own is written
    E* xs = data<D>(h);
    E* ns = data<D>(normed);
    E* qs = data<D>(q);
    E* as = data<D>(act);
    P* kp = reinterpret_cast<P*>(k_pool.data_ptr());
    P* vp = reinterpret_cast<P*>(v_pool.data_ptr());
    std::vector<E> head(hd_);  // a head between its q/k norm and its rope
    std::vector<E> key(same ? 0 : hd_);  // a new key before it is rounded to the pool's P

    for (int64_t l = 0; l < L; ++l) {
      const at::Tensor* w = w_.data() + kPerLayer * l;
      const int64_t* kind = kinds_.data() + 4 * l;
      const bool sliding = windows_[l] > 0;
      const E* c = data<D>(sliding ? wcos : cos);
      const E* s = data<D>(sliding ? wsin : sin);
      const E* q_norm = w[kQNorm].numel() ? data<D>(w[kQNorm]) : nullptr;
      const E* k_norm = w[kKNorm].numel() ? data<D>(w[kKNorm]) : nullptr;
      for (int64_t b = 0; b < B; ++b) {  // the rows this layer's K/V go to, for writing
        const char* kd = reinterpret_cast<const char*>(kp + (l * S + sp[b]) * row);
        const char* vd = reinterpret_cast<const char*>(vp + (l * S + sp[b]) * row);
        for (int64_t at = 0; at < row * static_cast<int64_t>(sizeof(P)); at += 64) {
          __builtin_prefetch(kd + at, 1, 3);
          __builtin_prefetch(vd + at, 1, 3);
        }
      }

      norm_rows<D>(xs, w[kAttnNorm], B, ns);
      auto qkv = linear<D>(normed, w[kQkv], w[kQkvScales], w[kQkvBias], kind[0], qn + 2 * row);
      const E* qkvs = data<D>(qkv);
      const int64_t width = qn + 2 * row;
      // q/k norm (Qwen3, Gemma 3) of one head, then its rope, into out
      auto rotate = [&](const E* x, const E* norm, const E* cb, const E* sb, E* out) {
        if (norm) {
          rms_norm_row<D>(x, norm, hd_, eps_, fp32_scale_, head.data());
          x = head.data();
        }
        rope_head<D>(x, cb, sb, hd_, out);
      };
      for (int64_t b = 0; b < B; ++b) {
        const E* r = qkvs + b * width;
        const E* cb = c + b * hd_;
        const E* sb = s + b * hd_;
        E* qb = qs + b * qn;
        for (int64_t i = 0; i < H_; ++i) rotate(r + i * hd_, q_norm, cb, sb, qb + i * hd_);
        if (query_scale_ != 1.0f)  // q * query_scale, rounded (Gemma 3)
          for (int64_t i = 0; i < qn; ++i) qb[i] = D::put(D::get(qb[i]) * query_scale_);
        const int64_t at = (l * S + sp[b]) * row;
        if constexpr (same) {
          E* kq = reinterpret_cast<E*>(kp + at);
          for (int64_t i = 0; i < KVH_; ++i) rotate(r + qn + i * hd_, k_norm, cb, sb, kq + i * hd_);
          std::memcpy(vp + at, r + qn + row, row * sizeof(E));
        } else {  // rounded to the pool's dtype (nearest even, as torch's .to())
          static_assert(std::is_same_v<D, F32> && std::is_same_v<P, c10::Half>);
          for (int64_t i = 0; i < KVH_; ++i) {
            rotate(r + qn + i * hd_, k_norm, cb, sb, key.data());
            to_half(kp + at + i * hd_, key.data(), hd_);
          }
          to_half(vp + at, r + qn + row, row);
        }
      }
      auto att = at::empty_like(q);
      {
        RECORD_FUNCTION("tokenfleet::decode_attention", std::vector<c10::IValue>());
        decode_attention_for<typename D::T, P>(q, k_pool, v_pool, none_, none_, tab, past, l,
                                            block_size, windows_[l], att);
      }
      auto o = linear<D>(att.view({B, qn}), w[kO], w[kOScales], w[kOBias], kind[1], hidden_);
      residual<D>(xs, o, w[kAttnOutNorm], B);

      norm_rows<D>(xs, w[kMlpNorm], B, ns);
      auto gu = linear<D>(normed, w[kGateUp], w[kGateUpScales], w[kGateUpBias], kind[2], 2 * inter_);
      const E* g = data<D>(gu);
      for (int64_t b = 0; b < B; ++b)
        glu_row<D>(g + b * 2 * inter_, g + b * 2 * inter_ + inter_, as + b * inter_);
      auto down = linear<D>(act, w[kDown], w[kDownScales], w[kDownBias], kind[3], hidden_);
      residual<D>(xs, down, w[kMlpOutNorm], B);
    }
    norm_rows<D>(xs, final_norm_, B, ns);
    return normed;
  }

  template <typename D>
  static typename D::S* data(const at::Tensor& t) {  // (checked against the dtype above)
    return reinterpret_cast<typename D::S*>(t.data_ptr());
  }

  template <typename D, typename S = typename D::S>
  void norm_rows(const S* x, const at::Tensor& w, int64_t B, S* out) const {
    for (int64_t b = 0; b < B; ++b)
      rms_norm_row<D>(x + b * hidden_, data<D>(w), hidden_, eps_, fp32_scale_, out + b * hidden_);
  }

  // x += y, y first normalised by `norm` where the model has one (Gemma 3's norms of the
  // attention's and the MLP's outputs)
  template <typename D, typename S = typename D::S>
  void residual(S* x, at::Tensor& y, const at::Tensor& norm, int64_t B) const {
    S* ys = data<D>(y);
    if (norm.numel()) norm_rows<D>(ys, norm, B, ys);
    add_into<D>(x, ys, B * hidden_);
  }

  template <typename D>
  static at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales,
                           const at::Tensor& bias, int64_t kind, int64_t n) {
    // named as the ops are, so a profile (bench/tick_profile.py) sees the kernels
    at::Tensor y;
    if (kind == 1) {
      RECORD_FUNCTION("tokenfleet::int8_linear", std::vector<c10::IValue>());
      y = int8_linear(x, w, scales, n);
    } else if (kind == 2) {
      RECORD_FUNCTION("tokenfleet::q4_linear", std::vector<c10::IValue>());
      y = q4_linear(x, w, scales, n);
    } else {  // a dense bias goes in the matmul, as F.linear's
      return bias.numel() ? at::linear(x, w, bias) : at::linear(x, w);
    }
    if (bias.numel()) {  // y + bias, rounded: layers.linear on packed weights
      typename D::S* ys = data<D>(y);
      const typename D::S* bs = data<D>(bias);
      for (int64_t r = 0; r < x.size(0); ++r) add_into<D>(ys + r * n, bs, n);
    }
    return y;
  }

  template <typename D, typename S = typename D::S>
  static void add_into(S* x, const S* y, int64_t n) {  // x = x + y
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = D::put(D::get(x[i]) + D::get(y[i]));
  }

  template <typename D, typename S = typename D::S>
  void glu_row(const S* gate, const S* up, S* out) const {
    if (gelu_) {  // F.gelu(approximate="tanh")
      const float k = std::sqrt(2.0f / static_cast<float>(M_PI));
#pragma omp simd
      for (int64_t i = 0; i < inter_; ++i) {
        const float g = D::get(gate[i]);
        const float a = D::round(0.5f * g * (1.0f + std::tanh(k * (g + 0.044715f * g * g * g))));
        out[i] = D::put(a * D::get(up[i]));
      }
    } else if constexpr (std::is_same_v<D, F32>) {  // F.silu; expf vectorised by libmvec
#pragma omp simd
      for (int64_t i = 0; i < inter_; ++i) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    } else {  // F.silu
      int64_t i = 0;
#ifdef TOKENFLEET_BF16_DOT
      const __m512 one = _mm512_set1_ps(1.0f);
      for (; i + 16 <= inter_; i += 16) {
        const __m512 g = widen16(gate + i);
        const __m512 a = round16(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(a, widen16(up + i)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
      }
#endif
      for (; i < inter_; ++i) {
        const float g = bf(gate[i]);
        out[i] = to_bf(round_bf(g / (1.0f + expf(-g))) * bf(up[i]));
      }
    }
  }

  std::vector<at::Tensor> w_;
  std::vector<int64_t> kinds_, windows_;
  at::Tensor final_norm_, embed_;
  double embed_scale_;
  at::ScalarType dtype_;
  const c10::optional<at::Tensor> none_;
  int64_t H_, KVH_, hd_, hidden_, inter_;
  float eps_;
  bool gelu_, fp32_scale_;
  float query_scale_;
};

// Which build of int8_linear / q4_linear this library holds: "avx512-vnni", "avx2", or ""
// (neither: the ops refuse, model/quant.py keeps torch's layouts).
std::string int_kernels() {
#if defined(TOKENFLEET_VNNI)
  return "avx512-vnni";
#elif defined(TOKENFLEET_INT_AVX2)
  return "avx2";
#else
  return "";
#endif
}

}  // namespace

TORCH_LIBRARY(tokenfleet, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, std::vector<int64_t>,
                       at::Tensor, at::Tensor, double, int64_t, int64_t, int64_t, int64_t,
                       int64_t, double, bool, bool, double>())
      .def("run", &DecodeStack::run)
      .def("decode", &DecodeStack::decode);
  m.def("int8_linear(Tensor x, Tensor w, Tensor scales, int n) -> Tensor");
  m.def("q4_linear(Tensor x, Tensor w, Tensor dm, int n) -> Tensor");
  m.def("int_kernels() -> str", &int_kernels);
  m.def(
      "decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor? k_new, Tensor? v_new, "
      "Tensor tables, Tensor past, int layer, int block_size, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenfleet, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("int8_linear", &int8_linear);
  m.impl("q4_linear", &q4_linear);
}
