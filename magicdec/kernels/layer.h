// Small operators of a decoder layer, one pass each over a forward's rows: RMSNorm (with the residual add before
// it, fused), RoPE, the gated MLP's activation times its up projection (`glu`), and the store of the new K/V rows
// into the block pool; and a Vegas draft's selection of the positions a verification attended to most
// (`top_positions`). In a decode-sized forward (a few tokens a row) each is a few microseconds of arithmetic, where
// torch's operators spend tens on dispatch and on the chains of elementwise kernels they are composed of (F.rms_norm
// alone was 74 us a call at 32 rows of SmolLM2 in bf16).
//
// Plain C++ over the element type T of the path's compute dtype (bf16 on avx512bf16, held as uint16_t; float on avx2),
// compiled with each path's flags, which vectorize the inner loops. Every row is computed by one thread in a fixed
// order whatever the other rows are, so a row gets the same bits in any batch (a verification forward and the
// one-token steps agree). Rounding follows torch's operators: a bf16 result is rounded where torch rounds it (RoPE's
// x * cos and rot(x) * sin before their sum; RMSNorm once, after the weight), so RoPE gives torch's bits and RMSNorm
// differs only where its own order of adding the squares rounds the scale otherwise.
#pragma once
#include <ATen/record_function.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <memory>
#include <vector>

#include "common.h"
#include "elementwise.h"

// Without trapping math the compiler if-converts the selects of these loops and vectorizes them; it changes no
// result: nothing here reads the floating-point exception flags. Without contraction a product and a sum round as
// torch's separate operators round them (an fp32 RoPE would otherwise fuse x * cos + rot * sin into one FMA).
#pragma GCC push_options
#pragma GCC optimize("no-trapping-math", "fp-contract=off")

namespace magicdec {
namespace layer {

// Elements are float (the avx2 path) or bf16 held as uint16_t (avx512bf16), widened to float for the arithmetic and
// narrowed back with round-to-nearest-even (NaN stays NaN), as torch's casts do; branch-free, so loops vectorize.
inline float widen(float x) { return x; }
inline float widen(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <class T>
inline T narrow(float x);
template <>
inline float narrow<float>(float x) {
  return x;
}
template <>
inline uint16_t narrow<uint16_t>(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

// Rows per task of at::parallel_for: rows are independent, and a task must be worth waking a thread for.
constexpr int64_t kGrainElements = 1 << 14;
inline int64_t grain(int64_t per_row) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, per_row)); }

// out[r] = rms_norm(x[r]) * w, rounded once as torch rounds it; where `residual` is given, x[r] = residual[r] + x[r]
// first (rounded to T and written back into residual): `x = x + h; normed = norm(x)` in one pass. Rows of `dim`
// elements, sx, sr and so apart in x, residual and out.
template <class T>
void rms_norm_rows(const T* x, T* residual, const T* w, T* out, int64_t rows, int64_t dim, int64_t sx,
                   int64_t sr, int64_t so, float eps) {
  at::parallel_for(0, rows, grain(dim), [&](int64_t begin, int64_t end) {
    std::unique_ptr<float[]> buffer(new float[dim]);
    float* h = buffer.get();
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * sx;
      T* rr = residual ? residual + r * sr : nullptr;
      for (int64_t i = 0; i < dim; ++i) {
        h[i] = rr ? widen(narrow<T>(widen(rr[i]) + widen(xr[i]))) : widen(xr[i]);
      }
      float acc[16] = {};
      int64_t i = 0;
      for (; i + 16 <= dim; i += 16) {
        for (int j = 0; j < 16; ++j) acc[j] += h[i + j] * h[i + j];
      }
      for (; i < dim; ++i) acc[0] += h[i] * h[i];
      float sum = 0.0f;
      for (int j = 0; j < 16; ++j) sum += acc[j];
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(dim) + eps);
      T* o = out + r * so;
      for (int64_t k = 0; k < dim; ++k) {
        if (rr) rr[k] = narrow<T>(h[k]);
        o[k] = narrow<T>(h[k] * inv * widen(w[k]));
      }
    }
  });
}

// RoPE in the half-split (Hugging Face) convention: out[b, h, t] = x[b, h, t] * cos[b, t] + rot(x[b, h, t]) *
// sin[b, t], rot(x) = (-x2, x1), each product rounded to T before the sum as torch rounds it. x [B, H, q, D] with
// any strides but a contiguous last dim; cos, sin [B, q, D] contiguous; out [B, H, q, D] contiguous.
template <class T>
void rope_rows(const T* x, const T* cos, const T* sin, T* out, int64_t B, int64_t H, int64_t q, int64_t D,
               int64_t sb, int64_t sh, int64_t sq) {
  const int64_t half = D / 2;
  at::parallel_for(0, B * H * q, grain(D), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const int64_t t = n % q, h = (n / q) % H, b = n / (q * H);
      const T* xr = x + b * sb + h * sh + t * sq;
      const T* c = cos + (b * q + t) * D;
      const T* s = sin + (b * q + t) * D;
      T* o = out + n * D;
      for (int64_t i = 0; i < half; ++i) {
        o[i] = narrow<T>(widen(narrow<T>(widen(xr[i]) * widen(c[i]))) +
                         widen(narrow<T>(-widen(xr[i + half]) * widen(s[i]))));
      }
      for (int64_t i = half; i < D; ++i) {
        o[i] = narrow<T>(widen(narrow<T>(widen(xr[i]) * widen(c[i]))) +
                         widen(narrow<T>(widen(xr[i - half]) * widen(s[i]))));
      }
    }
  });
}

// out[r, j] = act(x[r, j]) * x[r, H + j]: the gated MLP's activation of its gate times its up projection, from the
// fused projection's rows x [rows, 2H] (row stride sx) into out [rows, H], act rounded to T before the product as
// torch rounds F.silu's (or F.gelu's) output. act: SiLU, or GELU's tanh approximation where `gelu`.
template <class T, bool kGelu>
void glu_rows(const T* x, T* out, int64_t rows, int64_t H, int64_t sx) {
  at::parallel_for(0, rows, grain(2 * H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T *g = x + r * sx, *u = g + H;
      T* o = out + r * H;
      for (int64_t j = 0; j < H; ++j) {
        const float a = kGelu ? elementwise::gelu_tanh(widen(g[j])) : elementwise::silu(widen(g[j]));
        o[j] = narrow<T>(widen(narrow<T>(a)) * widen(u[j]));
      }
    }
  });
}

// pool[block[n], h, offset[n]] = x[b, h, t] for n = b * q + t: a forward's new K or V rows x [B, H, q, D] written
// into a block pool [NB, H, BS, D] (any strides but a contiguous last dim) as index_put_ writes them, a row's D
// elements in one copy. Positions that name the same slot (idle rows riding along into the null block) are written
// in turn by one task.
template <class T>
void store_rows(const T* x, T* pool, const int64_t* block, const int64_t* offset, int64_t B, int64_t H, int64_t q,
                int64_t D, const int64_t* sx, const int64_t* sp) {
  at::parallel_for(0, H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      for (int64_t n = 0; n < B * q; ++n) {
        const int64_t b = n / q, t = n % q;
        std::memcpy(pool + block[n] * sp[0] + h * sp[1] + offset[n] * sp[2], x + b * sx[0] + h * sx[1] + t * sx[2],
                    D * sizeof(T));
      }
    }
  });
}

// The operators over tensors of the path's compute dtype T (checked by the Python side, `kernels.fuses`).
template <class T>
struct LayerOps {
  static T* ptr(const at::Tensor& t) { return static_cast<T*>(t.data_ptr()); }

  // x [..., dim] -> rms_norm(x) * w; with residual [..., dim] (same shape): residual += x first, in place.
  static at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps,
                             const std::optional<at::Tensor>& residual) {
    const int64_t dim = x.size(-1), rows = x.numel() / dim;
    const auto x2 = x.reshape({rows, dim});
    auto out = at::empty({rows, dim}, x.options());
    T* res = nullptr;
    int64_t sr = 0;
    if (residual) {
      TORCH_CHECK(residual->is_contiguous() && residual->sizes() == x.sizes(), "residual: x's shape, contiguous");
      res = static_cast<T*>(residual->data_ptr());
      sr = dim;
    }
    TORCH_CHECK(x2.stride(1) == 1 && w.is_contiguous() && w.numel() == dim, "rms_norm: contiguous rows and weight");
    rms_norm_rows<T>(ptr(x2), res, ptr(w), ptr(out), rows, dim, x2.stride(0), sr, dim,
                     static_cast<float>(eps));
    return out.view(x.sizes());
  }

  // x [..., 2H] (gate, then up) -> act(gate) * up [..., H], contiguous; act: SiLU, or GELU (tanh) where `gelu`.
  static at::Tensor glu(const at::Tensor& x, bool gelu) {
    const int64_t H = x.size(-1) / 2, rows = x.numel() / (2 * H);
    TORCH_CHECK(x.size(-1) % 2 == 0 && x.stride(-1) == 1, "glu: rows of gate and up with a contiguous last dim");
    const auto x2 = x.reshape({rows, 2 * H});
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = H;
    auto out = at::empty(shape, x.options());
    (gelu ? glu_rows<T, true> : glu_rows<T, false>)(ptr(x2), ptr(out), rows, H, x2.stride(0));
    return out;
  }

  // k, v [B, KV, q, D] into the pools kc, vc [NB, KV, BS, D] at (block, offset) [B, q] (int64)
  static void store_kv(const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& block, const at::Tensor& offset) {
    const auto b = block.contiguous(), o = offset.contiguous();
    for (const auto& [pool, x] : {std::pair{kc, k}, std::pair{vc, v}}) {
      TORCH_CHECK(pool.dim() == 4 && x.dim() == 4 && pool.stride(3) == 1 && x.stride(3) == 1 &&
                      pool.size(1) == x.size(1) && pool.size(3) == x.size(3) && b.numel() == x.size(0) * x.size(2),
                  "store_kv: pools [NB, KV, BS, D] and rows [B, KV, q, D] with contiguous last dims, [B, q] indices");
      const int64_t sx[] = {x.stride(0), x.stride(1), x.stride(2)}, sp[] = {pool.stride(0), pool.stride(1),
                                                                           pool.stride(2)};
      store_rows<T>(ptr(x), ptr(pool), b.data_ptr<int64_t>(), o.data_ptr<int64_t>(), x.size(0), x.size(1), x.size(2),
                    x.size(3), sx, sp);
    }
  }

  // x [B, H, q, D] (contiguous last dim), cos / sin [B, q, D] -> rotated x [B, H, q, D], contiguous
  static at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1 && cos.is_contiguous() && sin.is_contiguous(),
                "rope: x [B, H, q, D] with a contiguous last dim, contiguous cos and sin");
    auto out = at::empty(x.sizes(), x.options());
    rope_rows<T>(ptr(x), ptr(cos), ptr(sin), ptr(out), x.size(0), x.size(1),
                 x.size(2), x.size(3), x.stride(0), x.stride(1), x.stride(2));
    return out;
  }
};

// The number of bins of `top_of_row`'s histogram: a score's bits above bit 21 (its exponent and 2 mantissa bits).
constexpr int64_t kSelectBins = 1 << 11;

inline uint32_t score_bits(const float* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}

// out [k] = the k positions of largest score among row[first:last) (scores >= 0, ordered as their bits), ascending,
// -1 leading where there are fewer. A histogram of the scores' top bits finds the bin the k-th largest lies in;
// everything above it is taken, and only the positions in that bin are ordered, by keys that break ties to the lower
// position (one pass over the row and a partial sort of a few positions, where sorting every position's key took 5x
// as long).
inline void top_of_row(const float* row, int64_t first, int64_t last, int64_t k, std::vector<uint32_t>& counts,
                       std::vector<uint64_t>& ties, int64_t* out) {
  const int64_t n = last - first, m = std::min(n, k);
  std::fill(out, out + (k - m), -1);
  int64_t* taken = out + (k - m);
  if (n <= k) {
    for (int64_t i = 0; i < n; ++i) taken[i] = first + i;
    return;
  }
  std::fill(counts.begin(), counts.end(), 0u);
  for (int64_t i = first; i < last; ++i) ++counts[score_bits(row + i) >> 21];
  int64_t bin = kSelectBins - 1, above = 0;  // the bin of the k-th largest, and how many lie above it
  while (above + static_cast<int64_t>(counts[bin]) < k) above += counts[bin--];
  ties.clear();
  int64_t j = 0;
  for (int64_t i = first; i < last; ++i) {
    const uint32_t bits = score_bits(row + i);
    if (static_cast<int64_t>(bits >> 21) > bin) {
      taken[j++] = i;
    } else if (static_cast<int64_t>(bits >> 21) == bin) {
      ties.push_back(static_cast<uint64_t>(bits) << 32 | (0xFFFFFFFFu - static_cast<uint32_t>(i)));
    }
  }
  const int64_t rest = k - above;
  std::nth_element(ties.begin(), ties.begin() + (rest - 1), ties.end(), std::greater<uint64_t>());
  for (int64_t t = 0; t < rest; ++t) taken[j++] = 0xFFFFFFFFu - static_cast<uint32_t>(ties[t]);
  std::sort(taken, taken + k);
}

// Per row r of scores [R, H, L] (fp32, contiguous; batch row r % B of hi [B]), summed over its H heads (in order, as
// torch sums them): the k positions of largest sum among [lo, hi[r % B]) (within [0, L)), ascending, -1 in the leading
// entries where there are fewer than k. Scores must be >= 0 (attention shares). Ties go to the lower position, so a
// row's selection depends on its scores alone (`top_of_row`; torch's topk over 30 layers of 32 rows of 8k positions
// took 70 ms on a Zen 4). The heads are summed here, a row at a time in the thread's buffer, rather than by torch
// beforehand, which took as long but left a temporary the size of the sums (31 MB at 30 layers x 32 rows x 8k).
inline at::Tensor top_positions(const at::Tensor& scores, const at::Tensor& hi, int64_t lo, int64_t k) {
  TORCH_CHECK(scores.dim() == 3 && scores.scalar_type() == at::kFloat && scores.is_contiguous(),
              "top_positions: contiguous fp32 scores [R, H, L] expected, got ", scores.sizes());
  TORCH_CHECK(hi.dim() == 1 && hi.scalar_type() == at::kLong && hi.size(0) > 0 && scores.size(0) % hi.size(0) == 0,
              "top_positions: int64 ends [B] with B dividing the rows of scores expected, got ", hi.sizes());
  TORCH_CHECK(k > 0, "top_positions: k must be positive");
  const int64_t R = scores.size(0), H = scores.size(1), L = scores.size(2), B = hi.size(0);
  const auto ends = hi.contiguous();
  auto out = at::empty({R, k}, hi.options());
  const float* s = scores.data_ptr<float>();
  const int64_t* e = ends.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> counts(kSelectBins);
    std::vector<uint64_t> ties;
    std::vector<float> summed(H > 1 ? L : 0);
    for (int64_t r = begin; r < end; ++r) {
      const float* heads = s + r * H * L;
      const int64_t first = std::max<int64_t>(lo, 0), last = std::max(first, std::min(e[r % B], L));
      const float* row = heads;
      if (H > 1) {
        for (int64_t i = first; i < last; ++i) summed[i] = heads[i];
        for (int64_t h = 1; h < H; ++h)
          for (int64_t i = first; i < last; ++i) summed[i] += heads[h * L + i];
        row = summed.data();
      }
      top_of_row(row, first, last, k, counts, ties, o + r * k);
    }
  });
  return out;
}

// The signature of a path's linear kernel: x [M, K] (contiguous) @ packed weights -> [M, N] (fp32: fp32 outputs;
// tiles: on AMX tiles).
using LinearFn = at::Tensor (*)(const at::Tensor&, const at::Tensor&, int64_t, const std::optional<at::Tensor>&, bool,
                                bool);

// A decoder layer's operators before its attention and after it, one call each, so that a decode-sized forward pays
// one dispatch for each run of them where it paid a dozen (magicdec.model.Block). Each calls the operators above and
// the path's linear kernel as the Python layer calls them, in the same order on the same tensors: the same bits.
template <class T, LinearFn Linear>
struct Sublayers {
  // x [..., K] @ W^T (+ bias) -> [..., N], as magicdec.kernels.linear; recorded as its own event, so that a
  // profile tells the linear layers from the rest (magicdec.phases).
  static at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                           const std::optional<at::Tensor>& bias, bool tiles) {
    RECORD_FUNCTION("magicdec::linear", std::vector<c10::IValue>());
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    return Linear(x.reshape({-1, x.size(-1)}).contiguous(), packed, N, bias, false, tiles).view(shape);
  }

  static at::Tensor norm(const at::Tensor& x, const at::Tensor& w, double eps) {
    return LayerOps<T>::rms_norm(x, w, eps, std::nullopt);
  }

  // x [B, q, dim] -> the queries [B, H, q, hd] and keys [B, KV, q, hd], rotated by cos / sin [B, 1, q, hd], and the
  // values [B, KV, q, hd] (a view of the projection): the attention norm, the fused QKV projection, the Q/K norms
  // (where given), RoPE and the queries' scale (where given). With `real` [N] (a ragged forward's real tokens, indices
  // into the B * q): x is their [N, dim], projected alone and padded with zeros, as magicdec.model.Ragged pads.
  static std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_in(
      const at::Tensor& x, const at::Tensor& norm_w, double eps, const at::Tensor& wqkv,
      const std::optional<at::Tensor>& bias, int64_t heads, int64_t kv_heads, const at::Tensor& cos,
      const at::Tensor& sin, const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
      std::optional<double> q_scale, const std::optional<at::Tensor>& real, bool tiles) {
    const int64_t B = cos.size(0), q = cos.size(2), hd = cos.size(-1), width = (heads + 2 * kv_heads) * hd;
    auto qkv = linear(norm(x, norm_w, eps), wqkv, width, bias, tiles);
    if (real) qkv = qkv.new_full({B * q, width}, 0).index_copy_(0, *real, qkv);
    qkv = qkv.view({B, q, heads + 2 * kv_heads, hd}).transpose(1, 2);
    const auto parts = qkv.split_with_sizes({heads, kv_heads, kv_heads}, 1);
    at::Tensor xq = parts[0], xk = parts[1];
    if (q_norm) xq = norm(xq, *q_norm, eps);
    if (k_norm) xk = norm(xk, *k_norm, eps);
    const auto c = cos.select(1, 0), s = sin.select(1, 0);
    xq = LayerOps<T>::rope(xq, c, s);
    xk = LayerOps<T>::rope(xk, c, s);
    if (q_scale) xq = xq.mul(*q_scale);
    return {xq, xk, parts[2]};
  }

  // The rest of the layer after attention: x [B, q, dim] (the residual stream; added into in place where
  // contiguous), attention's output [B, KV, G*q, hd] for q = `tokens` -> the layer's output [B, q, dim]: the output
  // projection (and its norm, where given), the residual add with the MLP's norm, the gated MLP (and its norm, where
  // given) and its residual add. With `real` [N] (a ragged forward's real tokens): x is their [N, dim], and the rest
  // runs over them alone.
  static at::Tensor attention_out(at::Tensor x, const at::Tensor& attn, int64_t tokens, const at::Tensor& wo,
                                  const std::optional<at::Tensor>& post_attention_norm, const at::Tensor& ffn_norm,
                                  double eps, const at::Tensor& w13, int64_t ffn_dim, const at::Tensor& w2, bool gelu,
                                  const std::optional<at::Tensor>& post_ffn_norm, const std::optional<at::Tensor>& real,
                                  bool tiles) {
    const int64_t B = attn.size(0), q = tokens, dim = x.size(-1), hd = attn.size(3);
    const int64_t heads = attn.size(1) * attn.size(2) / q;
    auto out = attn.to(x.scalar_type()).reshape({B, heads, q, hd}).transpose(1, 2).reshape({B, q, heads * hd});
    if (real) out = out.reshape({B * q, heads * hd}).index_select(0, *real);
    auto h = linear(out, wo, dim, std::nullopt, tiles);
    if (post_attention_norm) h = norm(h, *post_attention_norm, eps);
    at::Tensor normed;
    if (x.is_contiguous()) {
      normed = LayerOps<T>::rms_norm(h, ffn_norm, eps, x);
    } else {
      x = x.add(h);
      normed = norm(x, ffn_norm, eps);
    }
    h = linear(LayerOps<T>::glu(linear(normed, w13, 2 * ffn_dim, std::nullopt, tiles), gelu), w2, dim, std::nullopt,
               tiles);
    if (post_ffn_norm) h = norm(h, *post_ffn_norm, eps);
    return x.add(h);
  }
};

}  // namespace layer
}  // namespace magicdec

#pragma GCC pop_options

// Registers the operators into the path's library (TORCH_LIBRARY_FRAGMENT(magicdec_<path>, m)), over T.
// linear: the path's magicdec::layer::LinearFn.
#define MAGICDEC_REGISTER_LAYER_OPS(m, T, linear)                                                            \
  m.def("rms_norm(Tensor x, Tensor w, float eps, Tensor(a!)? residual=None) -> Tensor",                     \
        &magicdec::layer::LayerOps<T>::rms_norm);                                                            \
  m.def("attention_in(Tensor x, Tensor norm, float eps, Tensor wqkv, Tensor? bias, int heads, int kv_heads, " \
        "Tensor cos, Tensor sin, Tensor? q_norm, Tensor? k_norm, float? q_scale, Tensor? real, bool tiles) "   \
        "-> (Tensor, Tensor, Tensor)", &magicdec::layer::Sublayers<T, linear>::attention_in);                  \
  m.def("attention_out(Tensor(a!) x, Tensor attn, int tokens, Tensor wo, Tensor? post_attention_norm, "        \
        "Tensor ffn_norm, float eps, Tensor w13, int ffn_dim, Tensor w2, bool gelu, Tensor? post_ffn_norm, "   \
        "Tensor? real, bool tiles) -> Tensor",                                                                 \
        &magicdec::layer::Sublayers<T, linear>::attention_out);                                                \
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor", &magicdec::layer::LayerOps<T>::rope);            \
  m.def("glu(Tensor x, bool gelu) -> Tensor", &magicdec::layer::LayerOps<T>::glu);                            \
  m.def("store_kv(Tensor(a!) kc, Tensor(b!) vc, Tensor k, Tensor v, Tensor block, Tensor offset) -> ()",      \
        &magicdec::layer::LayerOps<T>::store_kv);                                                             \
  m.def("top_positions(Tensor scores, Tensor hi, int lo, int k) -> Tensor", &magicdec::layer::top_positions)
