// The CPU sampler's draw from a row's most probable tokens (`sample`): one operator for a batch's rows of logits, where
// the same draw in torch (magicdec.sampling._sample_candidates) chains some 30 operators over each row's whole
// vocabulary (3.5 ms for 32 rows of SmolLM2's 49k logits, 12 ms for Gemma 3's 262k).
//
// A row's token is the exponential race of magicdec.sampling: argmax over the tokens its filters keep of p(x) / E(x),
// E an Exp(1) variate hashed from (seed, position, token id). The race is run over the row's K most probable tokens
// (K in `candidates`, smallest first) where that is the race over the whole vocabulary: where top-k keeps at most K
// tokens, or top-p's nucleus ends before the K-th; a row of temperature alone races every token (`race_all`). A row
// for which no K suffices (a wide nucleus, top-k past the largest K, a logit that is NaN or +inf, or all -inf) is left
// to the full path (`done` false).
//
// Per row: one pass for the maxima of blocks of kBlock logits, one for the softmax's denominator, and the candidates
// gathered from the blocks whose maximum reaches the K-th largest block maximum (the K-th largest logit is at least
// that: K blocks each hold a logit that large). The arithmetic is plain C++ compiled with each path's flags, which
// vectorize the passes; a row is drawn by one thread in a fixed order, so its token does not depend on the batch.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <tuple>
#include <utility>
#include <vector>

#include "common.h"
#include "elementwise.h"

#pragma GCC push_options
#pragma GCC optimize("no-trapping-math", "fp-contract=off")

namespace magicdec {
namespace sampler {

constexpr int64_t kBlock = 64;  // logits per block maximum

// splitmix64's finalizer and constants: the noise of magicdec.sampling.exponential_noise, bit for bit.
constexpr uint64_t kMul1 = 0xBF58476D1CE4E5B9ull, kMul2 = 0x94D049BB133111EBull, kGolden = 0x9E3779B97F4A7C15ull;
inline uint64_t mix(uint64_t x) {
  x = (x ^ (x >> 30)) * kMul1;
  x = (x ^ (x >> 27)) * kMul2;
  return x ^ (x >> 31);
}
inline uint64_t row_key(int64_t seed, int64_t position) {
  return mix(mix(static_cast<uint64_t>(seed)) + static_cast<uint64_t>(position) * kGolden);
}
inline float noise(uint64_t key, int64_t token) {
  const uint64_t h = mix(key + static_cast<uint64_t>(token) * kGolden);
  const double u = (static_cast<double>(h >> 11) + 0.5) * 0x1p-53;
  return static_cast<float>(-std::log(u));
}

struct Filters {
  float temperature;
  int64_t top_k;  // 0: none
  float top_p;    // 1: none
};

struct Scratch {  // a thread's, reused across its rows
  std::vector<float> block_max, nth;
  std::vector<uint64_t> pool;  // order keys (order_key) of the logits in the candidates' blocks
  std::vector<float> p;
};

// Eight floats as one value of GCC's vector extension: the block maxima's loop compiles to vector instructions on
// every path (the scalar form did not vectorize: a max reduction needs fast-math).
typedef float Lanes __attribute__((vector_size(32)));
typedef int32_t LaneMask __attribute__((vector_size(32)));
inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The row's block maxima into s.block_max; false where a logit is NaN (the full path decides those).
inline bool block_maxima(const float* x, int64_t V, Scratch& s) {
  constexpr int kLanes = sizeof(Lanes) / sizeof(float);
  const int64_t nb = (V + kBlock - 1) / kBlock, whole = V / kBlock;
  s.block_max.resize(nb);
  LaneMask nan = {};
  for (int64_t b = 0; b < whole; ++b) {
    Lanes m = load_lanes(x + b * kBlock);
    nan |= m != m;
    for (int64_t i = b * kBlock + kLanes; i < (b + 1) * kBlock; i += kLanes) {
      const Lanes v = load_lanes(x + i);
      m = v > m ? v : m;
      nan |= v != v;
    }
    float top = m[0];
    for (int j = 1; j < kLanes; ++j) top = m[j] > top ? m[j] : top;
    s.block_max[b] = top;
  }
  bool any_nan = false;
  for (int j = 0; j < kLanes; ++j) any_nan |= nan[j] != 0;
  if (whole < nb) {  // the last, partial block
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t i = whole * kBlock; i < V; ++i) {
      top = x[i] > top ? x[i] : top;
      any_nan |= x[i] != x[i];
    }
    s.block_max[whole] = top;
  }
  return !any_nan;
}

// sum over the row of exp(x / T - top): the softmax's denominator, in 16 interleaved partial sums.
inline float denominator(const float* x, int64_t V, float T, float top) {
  float part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= V; i += 16)
    for (int j = 0; j < 16; ++j) part[j] += elementwise::exp(x[i + j] / T - top);
  for (; i < V; ++i) part[i % 16] += elementwise::exp(x[i] / T - top);
  float z = 0.0f;
  for (float v : part) z += v;
  return z;
}

// A logit and its index as one integer that orders as (logit, then the lower index) do: the float's bits made
// monotone (negative values flipped), above the index's complement.
inline uint64_t order_key(float x, int64_t index) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits = (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
  return static_cast<uint64_t>(bits) << 32 | (0xFFFFFFFFu - static_cast<uint32_t>(index));
}
inline int64_t key_index(uint64_t key) { return 0xFFFFFFFFu - static_cast<uint32_t>(key); }

// s.pool[0:K) = the order keys of the row's K largest logits, largest first, ties to the lower index.
inline void top_candidates(const float* x, int64_t V, int64_t K, Scratch& s) {
  const int64_t nb = static_cast<int64_t>(s.block_max.size());
  s.nth.assign(s.block_max.begin(), s.block_max.end());
  std::nth_element(s.nth.begin(), s.nth.begin() + (std::min(K, nb) - 1), s.nth.end(), std::greater<float>());
  const float floor = K >= nb ? -std::numeric_limits<float>::infinity() : s.nth[K - 1];
  s.pool.clear();
  for (int64_t b = 0; b < nb; ++b) {
    if (s.block_max[b] < floor) continue;
    for (int64_t i = b * kBlock, end = std::min(V, (b + 1) * kBlock); i < end; ++i)
      if (x[i] >= floor) s.pool.push_back(order_key(x[i], i));
  }
  std::nth_element(s.pool.begin(), s.pool.begin() + (K - 1), s.pool.end(), std::greater<uint64_t>());
  std::sort(s.pool.begin(), s.pool.begin() + K, std::greater<uint64_t>());
}

// The draw from the K candidates in s.pool, where the filters keep no other token: (done, index into the pool).
// p: their probabilities (softmax of logits / T, denominator z), zero past top-k, renormalized over top-k where it
// fits; the nucleus keeps a candidate unless the more probable ones already hold top_p.
inline std::pair<bool, int64_t> race_candidates(const float* x, int64_t K, const Filters& f, float top, float z,
                                                uint64_t key, const int64_t* ids, Scratch& s) {
  s.p.resize(K);
  float kept_mass = 0.0f;
  for (int64_t j = 0; j < K; ++j) {
    const bool in_top_k = f.top_k == 0 || j < f.top_k;
    s.p[j] = in_top_k ? elementwise::exp(x[key_index(s.pool[j])] / f.temperature - top) / z : 0.0f;
    kept_mass += s.p[j];
  }
  const bool k_fits = f.top_k > 0 && f.top_k <= K;
  if (k_fits)
    for (int64_t j = 0; j < K; ++j) s.p[j] /= kept_mass;
  float floor = 0.0f;
  if (f.top_p < 1.0f) {
    float before = 0.0f;  // the mass of the candidates more probable than j
    int64_t n_keep = 0;
    for (int64_t j = 0; j < K && before < f.top_p; ++j, ++n_keep) before += s.p[j];
    floor = s.p[std::max<int64_t>(n_keep, 1) - 1];
  }
  const bool done = k_fits || (f.top_p < 1.0f && f.top_k == 0 && s.p[K - 1] < floor);
  if (!done) return {false, 0};
  int64_t best = 0;
  float best_score = -1.0f;
  for (int64_t j = 0; j < K; ++j) {
    const int64_t index = key_index(s.pool[j]);
    const float score = (s.p[j] < floor ? 0.0f : s.p[j]) / noise(key, ids ? ids[index] : index);
    if (score > best_score) best = j, best_score = score;
  }
  return {true, best};
}

// The race over every token (temperature alone: no filter leaves fewer): the row's probabilities in one vectorized
// pass, then each token's noise; the index of the first largest ratio.
inline int64_t race_all(const float* x, int64_t V, float T, float top, float z, uint64_t key, const int64_t* ids,
                        Scratch& s) {
  s.p.resize(V);
  for (int64_t i = 0; i < V; ++i) s.p[i] = elementwise::exp(x[i] / T - top) / z;
  int64_t best = 0;
  float best_score = -1.0f;
  for (int64_t i = 0; i < V; ++i) {
    const float score = s.p[i] / noise(key, ids ? ids[i] : i);
    if (score > best_score) best = i, best_score = score;
  }
  return best;
}

// One row of logits x [V]: (done, token id).
inline std::pair<bool, int64_t> sample_row(const float* x, int64_t V, const Filters& f, uint64_t key,
                                           const int64_t* ids, const std::vector<int64_t>& candidates, Scratch& s) {
  const bool whole = f.top_k == 0 && !(f.top_p < 1.0f);
  const bool filtered = (f.top_k > 0 && f.top_k <= candidates.back()) || (f.top_k == 0 && f.top_p < 1.0f);
  if (!(whole || filtered) || !block_maxima(x, V, s)) return {false, 0};
  const float x_max = *std::max_element(s.block_max.begin(), s.block_max.end());
  if (!(std::abs(x_max) <= std::numeric_limits<float>::max())) return {false, 0};  // all -inf, or a +inf
  const float top = x_max / f.temperature;  // the largest of x / T: division by T > 0 keeps the order
  const float z = denominator(x, V, f.temperature, top);
  if (whole) {
    const int64_t i = race_all(x, V, f.temperature, top, z, key, ids, s);
    return {true, ids ? ids[i] : i};
  }
  for (int64_t K : candidates) {
    if (K >= V) break;
    top_candidates(x, V, K, s);
    const auto [done, j] = race_candidates(x, K, f, top, z, key, ids, s);
    if (done) return {true, ids ? ids[key_index(s.pool[j])] : key_index(s.pool[j])};
  }
  return {false, 0};
}

// logits [B, q, V] (fp32, contiguous last dim); per batch row: greedy, temperature, top_k, top_p, seed [B]; position
// [B, q]; ids [V] or None -> (tokens [B, q] int64, done [B, q] bool). Greedy rows are done with token 0 (the caller
// takes their argmax).
inline std::tuple<at::Tensor, at::Tensor> sample(const at::Tensor& logits, const at::Tensor& greedy,
                                                 const at::Tensor& temperature, const at::Tensor& top_k,
                                                 const at::Tensor& top_p, const at::Tensor& seed,
                                                 const at::Tensor& position, const std::optional<at::Tensor>& ids,
                                                 at::IntArrayRef candidate_counts) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat && logits.stride(2) == 1,
              "sample: fp32 logits [B, q, V] with a contiguous last dim expected, got ", logits.sizes());
  const int64_t B = logits.size(0), q = logits.size(1), V = logits.size(2);
  TORCH_CHECK(position.sizes() == at::IntArrayRef({B, q}), "sample: position [B, q] expected");
  TORCH_CHECK(!ids || (ids->dim() == 1 && ids->size(0) == V && ids->scalar_type() == at::kLong),
              "sample: int64 ids [V] expected");
  TORCH_CHECK(!candidate_counts.empty(), "sample: candidate counts expected");
  TORCH_CHECK(greedy.scalar_type() == at::kBool && temperature.scalar_type() == at::kFloat &&
                  top_k.scalar_type() == at::kLong && top_p.scalar_type() == at::kFloat &&
                  seed.scalar_type() == at::kLong && position.scalar_type() == at::kLong,
              "sample: greedy bool, temperature and top_p fp32, top_k, seed and position int64 expected");
  std::vector<int64_t> candidates(candidate_counts.begin(), candidate_counts.end());
  std::sort(candidates.begin(), candidates.end());
  const auto g = greedy.contiguous(), t = temperature.contiguous(), k = top_k.contiguous(), p = top_p.contiguous();
  const auto sd = seed.contiguous(), pos = position.contiguous();
  const auto id = ids ? std::optional<at::Tensor>(ids->contiguous()) : std::nullopt;
  auto tokens = at::empty({B, q}, pos.options());
  auto done = at::empty({B, q}, g.options());
  const float* x = logits.data_ptr<float>();
  const int64_t sb = logits.stride(0), sq = logits.stride(1);
  const bool* gp = g.data_ptr<bool>();
  const float *tp = t.data_ptr<float>(), *pp = p.data_ptr<float>();
  const int64_t *kp = k.data_ptr<int64_t>(), *sp = sd.data_ptr<int64_t>(), *posp = pos.data_ptr<int64_t>();
  const int64_t* idp = id ? id->data_ptr<int64_t>() : nullptr;
  int64_t* out = tokens.data_ptr<int64_t>();
  bool* dn = done.data_ptr<bool>();
  at::parallel_for(0, B * q, 1, [&](int64_t begin, int64_t end) {
    Scratch s;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / q;
      if (gp[b]) {
        dn[r] = true, out[r] = 0;
        continue;
      }
      const Filters f{tp[b], kp[b], pp[b]};
      const auto [ok, token] = sample_row(x + b * sb + (r % q) * sq, V, f, row_key(sp[b], posp[r]), idp, candidates, s);
      dn[r] = ok;
      out[r] = token;
    }
  });
  return {tokens, done};
}

}  // namespace sampler
}  // namespace magicdec

#pragma GCC pop_options

// Registers the sampler into the path's library (TORCH_LIBRARY_FRAGMENT(magicdec_<path>, m)).
#define MAGICDEC_REGISTER_SAMPLER(m)                                                                        \
  m.def("sample(Tensor logits, Tensor greedy, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, " \
        "Tensor position, Tensor? ids, int[] candidates) -> (Tensor, Tensor)",                               \
        &magicdec::sampler::sample)
