// Mamba2 decode steps for T consecutive tokens of each sequence, fused:
// dt = clip(softplus(dt_raw + dt_bias), lo, hi), dA = exp(-exp(A_log) dt),
// the SSM state update S = dA S + dt x Bᵀ and its output y = S C + D x, one
// token after the other with the state in registers. T = 1 is a decode
// step; T > 1 a speculative verify, which keeps the state after every
// position (KeepAll) so that accepting n drafts picks entry n-1.
//
// Body of an MLX custom CUDA kernel (MLX writes the signature). Inputs:
//   conv    [B, T, H*Dh + 2*G*N]  (InT)  silu(conv1d(...)) of the tokens: x, B, C
//   dt      [B, T, H]             (any float dtype)  raw time step
//   dt_bias [H], a_log [H], d [H]  (any float dtype)
//   limits  [2]                (float)  dt clip range
//   state   [B, H, Dh, N]      (float)
// Outputs: y [B, T, H, Dh] (InT); state_out [S, B, H, Dh, N] (float), the
// state after each token (S = T, KeepAll = 1) or after the last (S = 1).
// Template: InT, H, G, Dh, N, KeepAll. Launch: grid (32, Dh, B*H) threads in
// blocks of (32, 4, 1): one warp per state row, each lane N/32 columns.
constexpr int n_per = N / 32;
const int T = conv_shape[1];
const int B = conv_shape[0];
const int lane = threadIdx.x;
const int row = blockIdx.y * blockDim.y + threadIdx.y;
const int bh = blockIdx.z;
const int bi = bh / H;
const int h = bh % H;
const int g = h / (H / G);
constexpr int conv_dim = H * Dh + 2 * G * N;
const float decay = expf(static_cast<float>(a_log[h]));
const float skip = static_cast<float>(d[h]);

const float* sp = state + ((size_t)bh * Dh + row) * N;
float s[n_per];
#pragma unroll
for (int i = 0; i < n_per; ++i) s[i] = sp[lane + 32 * i];

for (int ti = 0; ti < T; ++ti) {
  const size_t bt = (size_t)bi * T + ti;
  const InT* cx = conv + bt * conv_dim;
  const InT* cb = cx + H * Dh + g * N;
  const InT* cc = cx + H * Dh + G * N + g * N;
  const float x = static_cast<float>(cx[h * Dh + row]);

  float t = static_cast<float>(dt[bt * H + h]) + static_cast<float>(dt_bias[h]);
  t = fmaxf(t, 0.f) + log1pf(expf(-fabsf(t)));
  t = fminf(fmaxf(t, limits[0]), limits[1]);
  const float da = expf(-decay * t);
  const float dtx = t * x;

  const bool keep = KeepAll || ti == T - 1;
  float* so = state_out + (((size_t)(KeepAll ? ti : 0) * B * H + bh) * Dh + row) * N;
  float out = 0.f;
#pragma unroll
  for (int i = 0; i < n_per; ++i) {
    const int n = lane + 32 * i;
    s[i] = s[i] * da + dtx * static_cast<float>(cb[n]);
    if (keep) so[n] = s[i];
    out += s[i] * static_cast<float>(cc[n]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffff, out, o);
  if (lane == 0) {
    y[(bt * H + h) * Dh + row] = static_cast<InT>(out + skip * x);
  }
}
