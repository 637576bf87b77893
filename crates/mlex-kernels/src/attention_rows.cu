// Causal attention of a few query rows over a longer KV cache in one launch:
// the rows of a speculative verify (T = 2..32 new tokens), each seeing the
// keys up to its own position (query i of T sees keys 0 .. L - T + i).
// MLX's CUDA attention sends such calls to cuDNN, which builds a plan for
// every new key length; its ops form costs a dozen launches a layer.
//
// Body of an MLX custom CUDA kernel (MLX writes the signature). Inputs:
//   q      [B, Hq, T, D]   (InT, any strides)
//   k, v   [B, Hkv, L, D]  (InT, any strides: the KV cache's prefix, read
//                           in place)
//   scale  [1]             (float)
// Output: o [B, Hq, T, D] (InT). Scores, softmax and the weighted sum in
// float (online softmax over the keys, as flash decoding does).
// Template: InT, D (head size, a multiple of 32), W (warps a block).
// Launch: grid (32*W, T, B*Hq) threads in blocks of (32*W, 1, 1): one block
// per query row; warp w takes keys w*U .. w*U+U-1, then W*U further on, ...;
// each lane D/32 dimensions.
constexpr int n_per = D / 32;
constexpr int U = 4;
const int lane = threadIdx.x % 32;
const int w = threadIdx.x / 32;
const int t = blockIdx.y;
const int bh = blockIdx.z;
const int Hq = q_shape[1];
const int T = q_shape[2];
const int Hkv = k_shape[1];
const int L = k_shape[2];
const int bi = bh / Hq;
const int h = bh % Hq;
const int hk = h / (Hq / Hkv);
const float sc = scale[0];
// MLX 0.32's kernel header defines no `inf`.
const float neg_inf = -__int_as_float(0x7f800000);

const InT* qp = q + bi * q_strides[0] + h * q_strides[1] + t * q_strides[2];
float qv[n_per];
#pragma unroll
for (int i = 0; i < n_per; ++i) qv[i] = static_cast<float>(qp[(lane * n_per + i) * q_strides[3]]) * sc;

const InT* kb = k + bi * k_strides[0] + hk * k_strides[1];
const InT* vb = v + bi * v_strides[0] + hk * v_strides[1];
const int visible = L - T + t + 1;
float m = neg_inf;
float l = 0.f;
float acc[n_per];
#pragma unroll
for (int i = 0; i < n_per; ++i) acc[i] = 0.f;
// U keys at a time: their loads are issued together, so a warp waits on
// memory once per U keys rather than once per key (one key at a time left
// the kernel bound by that wait: docs/BENCHMARKS.md).
for (int j0 = w * U; j0 < visible; j0 += W * U) {
  float kf[U][n_per];
  float vf[U][n_per];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    // Past the visible keys, re-read the last one; its weight is 0 below.
    const int j = j0 + u < visible ? j0 + u : visible - 1;
    const InT* kr = kb + j * k_strides[2] + lane * n_per * k_strides[3];
    const InT* vr = vb + j * v_strides[2] + lane * n_per * v_strides[3];
#pragma unroll
    for (int i = 0; i < n_per; ++i) {
      kf[u][i] = static_cast<float>(kr[i * k_strides[3]]);
      vf[u][i] = static_cast<float>(vr[i * v_strides[3]]);
    }
  }
  float s[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    s[u] = 0.f;
#pragma unroll
    for (int i = 0; i < n_per; ++i) s[u] += qv[i] * kf[u][i];
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
    for (int u = 0; u < U; ++u) s[u] += __shfl_xor_sync(0xffffffff, s[u], o);
  }
  float m_new = m;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (j0 + u < visible) m_new = fmaxf(m_new, s[u]);
  }
  const float corr = expf(m - m_new);
  l *= corr;
#pragma unroll
  for (int i = 0; i < n_per; ++i) acc[i] *= corr;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const float p = j0 + u < visible ? expf(s[u] - m_new) : 0.f;
    l += p;
#pragma unroll
    for (int i = 0; i < n_per; ++i) acc[i] += p * vf[u][i];
  }
  m = m_new;
}

// The warps' partial softmaxes, merged by the first warp.
__shared__ float part_m[W];
__shared__ float part_l[W];
__shared__ float part_acc[W][D];
if (lane == 0) {
  part_m[w] = m;
  part_l[w] = l;
}
#pragma unroll
for (int i = 0; i < n_per; ++i) part_acc[w][lane * n_per + i] = acc[i];
__syncthreads();
if (w == 0) {
  float big = neg_inf;
  for (int u = 0; u < W; ++u) {
    if (part_l[u] > 0.f) big = fmaxf(big, part_m[u]);
  }
  float total = 0.f;
  float weight[W];
  for (int u = 0; u < W; ++u) {
    weight[u] = part_l[u] > 0.f ? expf(part_m[u] - big) : 0.f;
    total += part_l[u] * weight[u];
  }
  InT* op = o + ((size_t)bh * T + t) * D + lane * n_per;
#pragma unroll
  for (int i = 0; i < n_per; ++i) {
    float x = 0.f;
    for (int u = 0; u < W; ++u) x += part_acc[u][lane * n_per + i] * weight[u];
    op[i] = static_cast<InT>(x / total);
  }
}
