// A bf16 linear layer on CPUs with AVX512-BF16 whose output rows do not depend on the batch: a row
// gets the same bits in a one-token step, in a verification forward and in a prefill chunk, whatever
// the other rows are. torch's bf16 matmul (oneDNN) rounds a row differently at different row counts and
// reads the weights at about half the memory bandwidth at one row.
//
// y [M, N] = x [M, K] @ W^T (+ bias [N]) with W packed once at load time (`pack` in magicdec.kernels):
// [N / 64, K / 2, 64, 2], i.e. for each group of 64 output columns and each pair of inputs, the 64
// columns' two weights side by side, so that one `vdpbf16ps` with a broadcast input pair advances 16
// output columns by two products. A task owns a group of columns and runs every input row against it,
// kRows rows at a time, reading each weight once per call. Every output element is the same sequence
// of fp32 operations over K whatever M is and however groups are shared among threads.
//
// On CPUs with AMX-BF16 (Intel Xeons since Sapphire Rapids) the same packed weights feed AMX tiles
// (`tiles`): a group's 64 columns are four 16-column B tiles (16 input pairs x 16 columns, rows 256
// bytes apart in the packing above), 16 input rows an A tile, and one `tdpbf16ps` multiplies a 16 x 32
// block of inputs by a 32 x 16 block of weights. The vector path is compute-bound from about 32 rows
// (a verification forward of a large batch); tiles do 16 times the products per instruction. A row is
// still computed alike in any batch: rows of a tile do not mix, and a layer takes the tiles (K a
// multiple of 32) or the vector path whatever M is.
#include <immintrin.h>

#include "amx.h"
#include "common.h"
#include "layer.h"
#include "sampler.h"

namespace {

constexpr int64_t kGroup = 64;  // output columns per packed group: 4 zmm of fp32 accumulators per row
constexpr int kVecs = kGroup / 16;
constexpr int kRows = 6;  // input rows per block: 6 x 4 accumulators, 4 weight vectors, 1 broadcast

// One output vector of 16 columns (m: the valid ones): rounded to bf16, or kept in fp32 (the LM head's logits,
// which are wanted in fp32: rounding them first would cost a pass over a step's largest output).
inline void put(uint16_t* y, __mmask16 m, __m512 v) { _mm256_mask_storeu_epi16(y, m, (__m256i)_mm512_cvtneps_pbh(v)); }
inline void put(float* y, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(y, m, v); }

// Stores `rows` x `cols` fp32 results [rows, 64] (+ bias) into y (row stride ldy): both paths end here.
template <class Out>
inline void store_rows(const float* acc, int rows, const float* bias, Out* y, int64_t ldy, int64_t cols) {
  for (int j = 0; j < kVecs; ++j) {
    const int64_t c = cols - 16 * j;
    if (c <= 0) break;
    const __mmask16 m = c >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << c) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
    for (int i = 0; i < rows; ++i) {
      put(y + i * ldy + 16 * j, m, _mm512_add_ps(_mm512_loadu_ps(acc + i * kGroup + 16 * j), b));
    }
  }
}

// `rows` input rows x [rows, K] against one packed group `w` [K / 2, 64, 2]; writes the group's `cols`
// valid columns of y (row stride ldy).
template <int rows, class Out>
inline void block(const uint16_t* x, const uint16_t* w, int64_t K, const float* bias, Out* y, int64_t ldy,
                  int64_t cols) {
  __m512 acc[rows][kVecs];
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < kVecs; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    const uint16_t* wk = w + k * kGroup;
    __m512bh wv[kVecs];
    for (int j = 0; j < kVecs; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wk + 32 * j);
    for (int i = 0; i < rows; ++i) {
      int32_t pair;
      __builtin_memcpy(&pair, x + i * K + k, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < kVecs; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  alignas(64) float out[rows * kGroup];
  for (int i = 0; i < rows; ++i)
    for (int j = 0; j < kVecs; ++j) _mm512_store_ps(out + i * kGroup + 16 * j, acc[i][j]);
  store_rows(out, rows, bias, y, ldy, cols);
}

constexpr int64_t kTileK = 32;  // inputs per tile step: 16 pairs
constexpr int64_t kTileRows = 16;
constexpr int64_t kPrefetch = 4 * kTileK * kGroup;  // weights read ahead: four tile steps (16 KiB)

// Tiles 0-3: the fp32 results of 16 columns each; 4: `rows` input rows x 32 inputs; 5-7: weights.
inline void configure_tiles(int rows) {
  magicdec::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t <= 4 ? rows : 16;
  }
  magicdec::load_tiles(cfg);
}

// `rows` (<= 16, the tiles configured for them) input rows x [rows, K] against one packed group `w`, on tiles;
// `out` [16, 64] fp32 receives the results.
inline void tile_block(const uint16_t* x, const uint16_t* w, int64_t K, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += kTileK) {
    const uint16_t* wk = w + k * kGroup;  // 16 pairs of inputs x 64 columns x 2
    for (int l = 0; l < 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch + 32 * l), _MM_HINT_T0);
    _tile_loadd(4, x + k, K * 2);
    _tile_loadd(5, wk, kGroup * 4);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, wk + 32, kGroup * 4);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(7, wk + 64, kGroup * 4);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, wk + 96, kGroup * 4);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, kGroup * 4);
  _tile_stored(1, out + 16, kGroup * 4);
  _tile_stored(2, out + 32, kGroup * 4);
  _tile_stored(3, out + 48, kGroup * 4);
}

template <class Out>
void run(const uint16_t* xp, const uint16_t* wp, const float* bp, Out* yp, int64_t M, int64_t K, int64_t N,
         bool tiles) {
  const int64_t groups = (N + kGroup - 1) / kGroup;
  if (tiles) {
    at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
      alignas(64) float acc[kTileRows * kGroup];
      int configured = 0;
      for (int64_t g = begin; g < end; ++g) {
        const int64_t n = g * kGroup, cols = std::min(kGroup, N - n);
        for (int64_t i = 0; i < M; i += kTileRows) {
          const int rows = static_cast<int>(std::min(kTileRows, M - i));
          if (rows != configured) configure_tiles(configured = rows);
          tile_block(xp + i * K, wp + g * K * kGroup, K, acc);
          store_rows(acc, rows, bp != nullptr ? bp + n : nullptr, yp + i * N + n, N, cols);
        }
      }
      _tile_release();
    });
    return;
  }
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n = g * kGroup, cols = std::min(kGroup, N - n);
      const uint16_t* wg = wp + g * K * kGroup;
      const float* bg = bp != nullptr ? bp + n : nullptr;
      magicdec::for_each_row_block<kRows>(M, [&](int64_t i, auto r) {
        block<decltype(r)::value>(xp + i * K, wg, K, bg, yp + i * N + n, N, cols);
      });
    }
  });
}

}  // namespace

at::Tensor linear_on(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                     const std::optional<at::Tensor>& bias, bool fp32, bool tiles) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "linear: x [M, K] bf16");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t groups = (N + kGroup - 1) / kGroup;
  TORCH_CHECK(K % 2 == 0 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
              packed.numel() == groups * K * kGroup, "linear: weights packed for K = ", K, " and N = ", N);
  at::Tensor b;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "linear: bias [N] expected");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options().dtype(fp32 ? at::kFloat : at::kBFloat16));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  tiles = tiles && K % kTileK == 0;
  if (tiles) magicdec::require_tiles("linear");
  if (fp32) {
    run(xp, wp, bp, y.data_ptr<float>(), M, K, N, tiles);
  } else {
    run(xp, wp, bp, reinterpret_cast<uint16_t*>(y.data_ptr()), M, K, N, tiles);
  }
  return y;
}

// bf16 linear layer over packed weights (AVX512-BF16), the same bits for a row in any batch; fp32: fp32 output
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const std::optional<at::Tensor>& bias,
                  bool fp32) {
  return linear_on(x, packed, N, bias, fp32, false);
}

at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                        const std::optional<at::Tensor>& bias, bool fp32) {
  return linear_on(x, packed, N, bias, fp32, true);
}

// (linear_tiles: on AMX tiles where K is a multiple of 32; call it only where tiles_ready())
TORCH_LIBRARY_FRAGMENT(magicdec_avx512bf16, m) {
  m.def("linear(Tensor x, Tensor packed, int N, Tensor? bias, bool fp32) -> Tensor", &linear);
  m.def("linear_tiles(Tensor x, Tensor packed, int N, Tensor? bias, bool fp32) -> Tensor", &linear_tiles);
  m.def("tiles_ready() -> bool", &magicdec::tiles_ready);
  MAGICDEC_REGISTER_LAYER_OPS(m, uint16_t, linear_on);
  MAGICDEC_REGISTER_SAMPLER(m);
}
