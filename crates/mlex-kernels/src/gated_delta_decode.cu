// Gated DeltaNet decode steps for T consecutive tokens of each sequence,
// fused: q/k split out of the convolved projection, L2 normalisation (q also
// scaled by Dk^-1/2), gates g = exp(-exp(A_log) * softplus(a + dt_bias)) and
// beta = sigmoid(b), and the delta-rule update of the f32 state with its
// output y = S q, one token after the other with the state in registers.
// T = 1 is a decode step; T > 1 a speculative verify, which keeps the state
// after every position (KeepAll) so that accepting n drafts picks entry n-1.
//
// Body of an MLX custom CUDA kernel (MLX writes the signature). Inputs:
//   conv    [B, T, 2*Hk*Dk + H*Dv]  (InT)  silu(conv1d(...)) of the tokens
//   a, b    [B, T, H]               (InT)
//   a_log   [H], dt_bias [H]        (any float dtype)
//   state   [B, H, Dv, Dk]          (float)
// Outputs: y [B, T, H, Dv] (InT); state_out [S, B, H, Dv, Dk] (float), the
// state after each token (S = T, KeepAll = 1) or after the last (S = 1).
// Template: InT, Hk, H, Dk, Dv, KeepAll. Launch: grid (32, Dv, B*H) threads
// in blocks of (32, 4, 1): one warp per state row, each lane Dk/32 columns.
constexpr int n_per = Dk / 32;
const int T = conv_shape[1];
const int B = conv_shape[0];
const int lane = threadIdx.x;
const int row = blockIdx.y * blockDim.y + threadIdx.y;
const int bh = blockIdx.z;
const int bi = bh / H;
const int h = bh % H;
const int hk = h / (H / Hk);
constexpr int conv_dim = 2 * Hk * Dk + H * Dv;
// mlx-lm: inv^2 * rms_norm(q, eps = 1e-6 * inv^2), inv * rms_norm(k, same).
const float inv = rsqrtf(static_cast<float>(Dk));
const float eps = 1e-6f * inv * inv;
const float a_decay = expf(static_cast<float>(a_log[h]));
const float bias = static_cast<float>(dt_bias[h]);

const float* sp = state + ((size_t)bh * Dv + row) * Dk;
float s[n_per];
#pragma unroll
for (int i = 0; i < n_per; ++i) s[i] = sp[lane + 32 * i];

for (int t = 0; t < T; ++t) {
  const size_t bt = (size_t)bi * T + t;
  const InT* cq = conv + bt * conv_dim + hk * Dk;
  const InT* ck = cq + Hk * Dk;
  const float v = static_cast<float>(conv[bt * conv_dim + 2 * Hk * Dk + h * Dv + row]);

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
  const float q_scale = inv * inv * rsqrtf(qq / Dk + eps);
  const float k_scale = inv * rsqrtf(kk / Dk + eps);

  const float av = static_cast<float>(a[bt * H + h]) + bias;
  const float softplus = fmaxf(av, 0.f) + log1pf(expf(-fabsf(av)));
  const float g = expf(-a_decay * softplus);
  const float beta = 1.f / (1.f + expf(-static_cast<float>(b[bt * H + h])));

  float mem = 0.f;
#pragma unroll
  for (int i = 0; i < n_per; ++i) {
    kv[i] *= k_scale;
    s[i] *= g;
    mem += s[i] * kv[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) mem += __shfl_xor_sync(0xffffffff, mem, o);
  const float delta = (v - mem) * beta;
  float out = 0.f;
  const bool keep = KeepAll || t == T - 1;
  float* so = state_out + (((size_t)(KeepAll ? t : 0) * B * H + bh) * Dv + row) * Dk;
#pragma unroll
  for (int i = 0; i < n_per; ++i) {
    s[i] += kv[i] * delta;
    out += s[i] * qv[i] * q_scale;
    if (keep) so[lane + 32 * i] = s[i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) out += __shfl_xor_sync(0xffffffff, out, o);
  if (lane == 0) {
    y[(bt * H + h) * Dv + row] = static_cast<InT>(out);
  }
}
