// One Mamba2 decode step for one token, fused: dt = clip(softplus(dt_raw +
// dt_bias), lo, hi), dA = exp(-exp(A_log) dt), the SSM state update
// S = dA S + dt x Bᵀ and its output y = S C + D x.
//
// Body of an MLX custom CUDA kernel (MLX writes the signature). Inputs:
//   conv    [B, H*Dh + 2*G*N]  (InT)  silu(conv1d(...)) of this token: x, B, C
//   dt      [B, H]             (any float dtype)  raw time step
//   dt_bias [H], a_log [H], d [H]  (any float dtype)
//   limits  [2]                (float)  dt clip range
//   state   [B, H, Dh, N]      (float)
// Outputs: y [B, H, Dh] (InT), state_out [B, H, Dh, N] (float).
// Template: InT, H, G, Dh, N. Launch: grid (32, Dh, B*H) threads in blocks
// of (32, 4, 1): one warp per state row, each lane N/32 columns.
constexpr int n_per = N / 32;
const int lane = threadIdx.x;
const int row = blockIdx.y * blockDim.y + threadIdx.y;
const int bh = blockIdx.z;
const int bi = bh / H;
const int h = bh % H;
const int g = h / (H / G);
constexpr int conv_dim = H * Dh + 2 * G * N;
const InT* cx = conv + (size_t)bi * conv_dim;
const InT* cb = cx + H * Dh + g * N;
const InT* cc = cx + H * Dh + G * N + g * N;
const float x = static_cast<float>(cx[h * Dh + row]);

float t = static_cast<float>(dt[bh]) + static_cast<float>(dt_bias[h]);
t = fmaxf(t, 0.f) + log1pf(expf(-fabsf(t)));
t = fminf(fmaxf(t, limits[0]), limits[1]);
const float da = expf(-expf(static_cast<float>(a_log[h])) * t);
const float dtx = t * x;

const float* sp = state + ((size_t)bh * Dh + row) * N;
float* so = state_out + ((size_t)bh * Dh + row) * N;
float out = 0.f;
#pragma unroll
for (int i = 0; i < n_per; ++i) {
  const int n = lane + 32 * i;
  const float s = sp[n] * da + dtx * static_cast<float>(cb[n]);
  so[n] = s;
  out += s * static_cast<float>(cc[n]);
}
#pragma unroll
for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffff, out, o);
if (lane == 0) {
  y[(size_t)bh * Dh + row] = static_cast<InT>(out + static_cast<float>(d[h]) * x);
}
