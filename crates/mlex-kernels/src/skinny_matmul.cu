// y = x @ w^T for a few rows of x, reading every weight once: the decode
// step of a batch (M = 2..64 sequences), where MLX's CUDA matmul pays a
// large-tile GEMM's fixed cost (17-25 us per product measured on the H200)
// for what is a bandwidth-bound weight sweep.
//
// Body of an MLX custom CUDA kernel (MLX writes the signature). Inputs:
//   x [R, K] (T), w [N, K] (T), both row-contiguous; K % 8 == 0; R <= M.
// Output: y [R, N] (T), accumulated in float.
// Template: T, M (the power of two at or above R: every template value is
// a separate run-time compilation, about a second each, so the row count
// itself is read from x's shape). Launch: grid (32, N, 1) threads in blocks
// of (32, 4, 1): one warp per output column n, each lane 8 consecutive k at
// a time.
const int lane = threadIdx.x;
const int n = blockIdx.y * blockDim.y + threadIdx.y;
const int N = w_shape[0];
const int K = w_shape[1];
const int R = x_shape[0];
if (n >= N) return;
float acc[M];
#pragma unroll
for (int m = 0; m < M; ++m) acc[m] = 0.f;
const T* wr = w + (size_t)n * K;
// U chunks of the weight row a lane loads at once, before using any: one
// wait on memory for four chunks. The order of the sums is unchanged.
constexpr int U = 4;
for (int k0 = lane * 8; k0 < K; k0 += 256 * U) {
  uint4 wv[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (k0 + u * 256 < K) wv[u] = *reinterpret_cast<const uint4*>(wr + k0 + u * 256);
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int k = k0 + u * 256;
    if (k >= K) break;
    const T* wp = reinterpret_cast<const T*>(&wv[u]);
    float wf[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) wf[i] = static_cast<float>(wp[i]);
#pragma unroll
    for (int m = 0; m < M; ++m) {
      if (m >= R) break;
      uint4 xv = *reinterpret_cast<const uint4*>(x + (size_t)m * K + k);
      const T* xp = reinterpret_cast<const T*>(&xv);
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) s += wf[i] * static_cast<float>(xp[i]);
      acc[m] += s;
    }
  }
}
#pragma unroll
for (int m = 0; m < M; ++m) {
  float v = acc[m];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  if (lane == 0 && m < R) y[(size_t)m * N + n] = static_cast<T>(v);
}
