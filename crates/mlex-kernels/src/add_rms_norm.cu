// A residual add and the RMS norm of its sum in one launch: h = x + y (in T,
// as MLX's add rounds it) and n = rms_norm(h) * w (as MLX's rms_norm: the
// normalised value rounded to T, then times the weight in T).
//
// Body of an MLX custom CUDA kernel (MLX writes the signature). Inputs:
//   x [R, H], y [R, H] (T, row-contiguous), w [H].
// Outputs: h [R, H], n [R, H] (T).
// Template: T, H, EPS_PICO (the epsilon in units of 1e-12). Launch: grid
// (256, R, 1) threads in blocks of (256, 1, 1): one block per row.
const int t = threadIdx.x;
const size_t row = blockIdx.y;
const T* xr = x + row * H;
const T* yr = y + row * H;
T* hr = h + row * H;
T* nr = n + row * H;
float ss = 0.f;
for (int i = t; i < H; i += 256) {
  const T s = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(yr[i]));
  hr[i] = s;
  const float f = static_cast<float>(s);
  ss += f * f;
}
__shared__ float part[8];
#pragma unroll
for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
if ((t & 31) == 0) part[t >> 5] = ss;
__syncthreads();
if (t < 32) {
  float v = t < 8 ? part[t] : 0.f;
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  if (t == 0) part[0] = v;
}
__syncthreads();
const float scale = rsqrtf(part[0] / H + EPS_PICO * 1e-12f);
for (int i = t; i < H; i += 256) {
  const float s = static_cast<float>(hr[i]);
  nr[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(static_cast<T>(s * scale)));
}
