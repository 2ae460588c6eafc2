// What the native kernels of every instruction set share: strided 16-bit tensors, the split of attention
// into (row, KV head, context chunk, block of query rows) tasks and the merge of the chunks' partial
// results, and the walk of a linear layer's rows in register blocks. Only plain C++ here: each kernel
// source includes it and is compiled with its own instruction-set flags. The kernels register as operators
// (torch.ops.magicdec_<path>) rather than as a Python module: these headers compile in a fifth of the time
// torch/extension.h takes, which is most of a build.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace magicdec {

// Query rows per task at most. A prefill chunk's hundreds of rows per KV head are split into blocks of this many:
// a block's scores and probabilities over a context chunk stay in L2 (2048 rows of Gemma 3 over 1024 positions were
// 12 MB), and a block skips the tiles none of its rows sees (the chunk's causal part, a sliding window's edges).
constexpr int64_t kBlockRows = 128;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// exp(x) as Cephes expf computes it: n = round(x log2 e), r = x - n ln 2 (ln 2 in two parts), then
// 1 + r + r^2 P(r) with P of degree 5 (kExpPoly, highest power first), times 2^n.
constexpr float kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

struct Strided {  // a [B, H, L, D] tensor with a contiguous last dim, as raw 16-bit words
  const uint16_t* data;
  int64_t sb, sh, sl;
  const uint16_t* at(int64_t b, int64_t h, int64_t l) const { return data + b * sb + h * sh + l * sl; }
};

inline Strided strided(const at::Tensor& t) {
  return {reinterpret_cast<const uint16_t*>(t.data_ptr()), t.stride(0), t.stride(1), t.stride(2)};
}

// The additive bias (0 / -inf) [B, 1, R, L] of a head's M query rows, M a multiple of R: query row m takes bias row
// m % R. The model passes one row per new token (R = q) for the G x q rows of a KV head's grouped queries (ordered
// query head, then token), so a forward builds and reads the bias once per token rather than once per query head.
// `first` is the bias row of a task's first query row.
struct Bias {
  Strided rows;
  int64_t R, first;
  const uint16_t* at(int64_t b, int64_t r, int64_t l) const { return rows.at(b, 0, r) + l; }  // bias row r
  int64_t row(int64_t m) const { return (first + m) % R; }  // bias row of the task's query row m
  int64_t distinct(int64_t M) const { return std::min(M, R); }  // bias rows that M consecutive query rows take
};

// The checks and the Bias of a kernel's bias operand for M query rows over L positions.
inline Bias bias_of(const at::Tensor& bias, int64_t M, int64_t L) {
  TORCH_CHECK(bias.size(2) > 0 && M % bias.size(2) == 0 && bias.size(3) >= L,
              "decode_attention: bias [B, 1, R, L] with R dividing the query rows (", M, ") expected, got ",
              bias.sizes());
  return {strided(bias), bias.size(2), 0};
}

// out[i] = the chunks' partial results of query row i merged by their maxima: sum_c w_c out_c / sum_c w_c sum_c,
// w_c = exp(max_c - max). A chunk the row sees nothing of (max -inf) is skipped.
template <int D>
void merge_chunks(int64_t rows, int64_t M, int64_t C, const float* pm, const float* ps, const float* po, float* op) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i % M, bh = i / M;
      float mx = kNegInf;
      for (int64_t c = 0; c < C; ++c) mx = std::max(mx, pm[(bh * C + c) * M + m]);
      float denom = 0.0f, acc[D] = {0.0f};
      for (int64_t c = 0; c < C; ++c) {
        const float cm = pm[(bh * C + c) * M + m];
        if (cm == kNegInf) continue;
        const float w = std::exp(cm - mx);
        denom += w * ps[(bh * C + c) * M + m];
        const float* o = po + ((bh * C + c) * M + m) * D;
        for (int d = 0; d < D; ++d) acc[d] += w * o[d];
      }
      for (int d = 0; d < D; ++d) op[i * D + d] = acc[d] / denom;
    }
  });
}

// Attention of M query rows per (row, KV head) over L positions in chunks of `chunk`, returning [B, H, M, D] fp32.
// make_task(bh, m0, rows, bias) builds the task of rows [m0, m0 + rows) of head bh (with the bias from its row m0);
// its run(b, h, l0, l1, buffers, max, sum, out) writes the chunk's maxima, sums and unnormalized outputs.
// A prefill chunk's many query rows are split into blocks of at most kBlockRows. A row's arithmetic does not depend
// on the block it is in: a tile hidden from all of a block's rows adds nothing to them whether skipped or not.
template <int D, class MakeTask>
at::Tensor attend_in_chunks(int64_t B, int64_t H, int64_t M, int64_t L, int64_t chunk, const Bias& bias,
                               const at::TensorOptions& opts, MakeTask make_task) {
  const int64_t C = (L + chunk - 1) / chunk, BHC = B * H * C;
  auto part_out = at::empty({BHC, M, D}, opts), part_max = at::empty({BHC, M}, opts);
  auto part_sum = at::empty({BHC, M}, opts);
  float *po = part_out.data_ptr<float>(), *pm = part_max.data_ptr<float>(), *ps = part_sum.data_ptr<float>();
  const int64_t blocks = (M + kBlockRows - 1) / kBlockRows;
  const int64_t rows = (M + blocks - 1) / blocks;
  at::parallel_for(0, BHC * blocks, 1, [&](int64_t begin, int64_t end) {
    typename std::invoke_result_t<MakeTask, int64_t, int64_t, int64_t, Bias>::Buffers buffers;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m0 = task % blocks * rows, bhc = task / blocks, c = bhc % C, bh = bhc / C, h = bh % H, b = bh / H;
      if (m0 >= M) continue;
      Bias block_bias = bias;
      block_bias.first = m0 % bias.R;
      const auto work = make_task(bh, m0, std::min(rows, M - m0), block_bias);
      const int64_t first = bhc * M + m0;  // the block's first row among the partial results
      work.run(b, h, c * chunk, std::min(L, (c + 1) * chunk), buffers, pm + first, ps + first, po + first * D);
    }
  });
  auto out = at::empty({B, H, M, D}, opts);
  merge_chunks<D>(B * H * M, M, C, pm, ps, po, out.data_ptr<float>());
  return out;
}

// Runs block(i, std::integral_constant<int, r>) over rows [0, M) in blocks of kRows rows, the last block shorter:
// every row meets the same arithmetic whichever block it falls in.
template <int kRows, class Block>
void for_each_row_block(int64_t M, Block block) {
  int64_t i = 0;
  for (; i + kRows <= M; i += kRows) block(i, std::integral_constant<int, kRows>{});
  if constexpr (kRows > 1) {
    if (M - i > 0) for_each_row_block<kRows - 1>(M - i, [&](int64_t j, auto r) { block(i + j, r); });
  }
}

}  // namespace magicdec
