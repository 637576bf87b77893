// The query/key preparation of an attention layer for a few tokens, fused:
// the per-head RMS norms of q and k (optional) and the rotary embedding at
// each row's position, for q and k in one launch instead of four.
//
// Body of an MLX custom CUDA kernel (MLX writes the signature). Inputs:
//   q [B, HQ, L, D], k [B, HK, L, D] (T, row-contiguous)
//   qw [D], kw [D]   the q/k norm weights (read only when NORM)
//   pos [P] int32    the position of each batch row's first token (P = 1: all rows)
//   rope [DIMS / 2 + 1] float   the angle per position of each rotated pair,
//                               then the position scale (as MLX's rope:
//                               theta = (scale * position) * inv_freq)
// Outputs: qo [B, HQ, L, D], ko [B, HK, L, D] (T).
// Template: T, HQ, HK, L, D, DIMS (rotated dims, even, <= D), NORM, TRAD
// (rotate consecutive pairs instead of halves), EPS_PICO (the norms' epsilon
// in units of 1e-12: MLX's template arguments are integers).
// Launch: grid (32, B * (HQ + HK) * L, 1) threads in blocks of (32, 4, 1):
// one warp per head row, each lane every 32nd element.
constexpr int PER = (D + 31) / 32;
__shared__ float buf[4][D];
const int lane = threadIdx.x;
const int row = blockIdx.y * blockDim.y + threadIdx.y;
const int B = q_shape[0];
const int q_rows = B * HQ * L;
if (row >= q_rows + B * HK * L) return;
const bool is_q = row < q_rows;
const int r = is_q ? row : row - q_rows;
const int b = r / ((is_q ? HQ : HK) * L);
const int l = r % L;
const T* x = (is_q ? q : k) + (size_t)r * D;
T* out = (is_q ? qo : ko) + (size_t)r * D;
float v[PER];
float ss = 0.f;
#pragma unroll
for (int i = 0; i < PER; ++i) {
  const int idx = lane + 32 * i;
  v[i] = idx < D ? static_cast<float>(x[idx]) : 0.f;
  ss += v[i] * v[i];
}
if (NORM) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
  const float scale = rsqrtf(ss / D + EPS_PICO * 1e-12f);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int idx = lane + 32 * i;
    if (idx < D) {
      const float w = is_q ? static_cast<float>(qw[idx]) : static_cast<float>(kw[idx]);
      // As MLX's rms_norm: the normalised value rounded to T, then scaled.
      v[i] = static_cast<float>(static_cast<T>(v[i] * scale)) * w;
      v[i] = static_cast<float>(static_cast<T>(v[i]));
    }
  }
}
#pragma unroll
for (int i = 0; i < PER; ++i) {
  const int idx = lane + 32 * i;
  if (idx < D) buf[threadIdx.y][idx] = v[i];
}
__syncwarp();
const int P = pos_shape[0];
const float p = rope[DIMS / 2] * static_cast<float>(pos[P == 1 ? 0 : b] + l);
#pragma unroll
for (int i = 0; i < PER; ++i) {
  const int idx = lane + 32 * i;
  if (idx >= D) continue;
  float y = v[i];
  if (idx < DIMS) {
    int pair, first;
    bool lead;
    if (TRAD) {
      pair = idx / 2; first = 2 * pair; lead = (idx % 2) == 0;
    } else {
      constexpr int half = DIMS / 2;
      pair = idx < half ? idx : idx - half; first = pair; lead = idx < half;
    }
    const int second = TRAD ? first + 1 : first + DIMS / 2;
    float s, c;
    sincosf(p * rope[pair], &s, &c);
    const float x1 = buf[threadIdx.y][first], x2 = buf[threadIdx.y][second];
    y = lead ? x1 * c - x2 * s : x1 * s + x2 * c;
  }
  out[idx] = static_cast<T>(y);
}
