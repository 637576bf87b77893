// One Gated DeltaNet decode step for one token, fused: q/k split out of the
// convolved projection, L2 normalisation (q also scaled by Dk^-1/2), gates
// g = exp(-exp(A_log) * softplus(a + dt_bias)) and beta = sigmoid(b), and the
// delta-rule update of the f32 state with its output y = S q.
//
// Body of an MLX custom CUDA kernel (MLX writes the signature). Inputs:
//   conv    [B, 2*Hk*Dk + H*Dv]  (InT)  silu(conv1d(...)) of this token
//   a, b    [B, H]               (InT)
//   a_log   [H], dt_bias [H]     (any float dtype)
//   state   [B, H, Dv, Dk]       (float)
// Outputs: y [B, H, Dv] (InT), state_out [B, H, Dv, Dk] (float).
// Template: InT, Hk, H, Dk, Dv. Launch: grid (32, Dv, B*H) threads in
// blocks of (32, 4, 1): one warp per state row, each lane Dk/32 columns.
constexpr int n_per = Dk / 32;
const int lane = threadIdx.x;
const int row = blockIdx.y * blockDim.y + threadIdx.y;
const int bh = blockIdx.z;
const int bi = bh / H;
const int h = bh % H;
const int hk = h / (H / Hk);
constexpr int conv_dim = 2 * Hk * Dk + H * Dv;
const InT* cq = conv + (size_t)bi * conv_dim + hk * Dk;
const InT* ck = cq + Hk * Dk;
const float v = static_cast<float>(conv[(size_t)bi * conv_dim + 2 * Hk * Dk + h * Dv + row]);

float qv[n_per], kv[n_per];
float qq = 0.f, kk = 0.f;
#pragma unroll
for (int i = 0; i < n_per; ++i) {
  qv[i] = static_cast<float>(cq[lane + 32 * i]);
  kv[i] = static_cast<float>(ck[lane + 32 * i]);
  qq += qv[i] * qv[i];
  kk += kv[i] * kv[i];
}
#pragma unroll
for (int o = 16; o > 0; o >>= 1) {
  qq += __shfl_xor_sync(0xffffffff, qq, o);
  kk += __shfl_xor_sync(0xffffffff, kk, o);
}
// mlx-lm: inv^2 * rms_norm(q, eps = 1e-6 * inv^2), inv * rms_norm(k, same).
const float inv = rsqrtf(static_cast<float>(Dk));
const float eps = 1e-6f * inv * inv;
const float q_scale = inv * inv * rsqrtf(qq / Dk + eps);
const float k_scale = inv * rsqrtf(kk / Dk + eps);

const float av = static_cast<float>(a[bh]) + static_cast<float>(dt_bias[h]);
const float softplus = fmaxf(av, 0.f) + log1pf(expf(-fabsf(av)));
const float g = expf(-expf(static_cast<float>(a_log[h])) * softplus);
const float beta = 1.f / (1.f + expf(-static_cast<float>(b[bh])));

const float* sp = state + ((size_t)bh * Dv + row) * Dk;
float* so = state_out + ((size_t)bh * Dv + row) * Dk;
float s[n_per];
float mem = 0.f;
#pragma unroll
for (int i = 0; i < n_per; ++i) {
  kv[i] *= k_scale;
  s[i] = sp[lane + 32 * i] * g;
  mem += s[i] * kv[i];
}
#pragma unroll
for (int o = 16; o > 0; o >>= 1) mem += __shfl_xor_sync(0xffffffff, mem, o);
const float delta = (v - mem) * beta;
float out = 0.f;
#pragma unroll
for (int i = 0; i < n_per; ++i) {
  s[i] += kv[i] * delta;
  out += s[i] * qv[i] * q_scale;
  so[lane + 32 * i] = s[i];
}
#pragma unroll
for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffff, out, o);
if (lane == 0) {
  y[(size_t)bh * Dv + row] = static_cast<InT>(out);
}
