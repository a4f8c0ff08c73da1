// Keel's CUDA kernels for inference, compiled by NVRTC at start-up (see cuda.rs). No headers
// are included, so the program compiles wherever NVRTC runs: 16-bit floats travel as their
// bits and are converted with PTX instructions. Every kernel computes in f32 and rounds to
// the tensor's type where the tch path it replaces rounds, so results match it closely.

typedef unsigned short u16;

#define KEEL_INF __int_as_float(0x7f800000)

struct bf16 { u16 bits; };
struct f16 { u16 bits; };

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(bf16 x) { return __uint_as_float(((unsigned)x.bits) << 16); }
__device__ __forceinline__ float to_f32(f16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits));
    return f;
}

template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f32<bf16>(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        bf16 nan = {(u16)((u >> 16) | 0x40u)};
        return nan;
    }
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
    bf16 out = {(u16)(u >> 16)};
    return out;
}
template <> __device__ __forceinline__ f16 from_f32<f16>(float x) {
    f16 out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out.bits) : "f"(x));
    return out;
}

// x rounded to T and back: where the tch path stores an intermediate tensor of type T.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_f32(from_f32<T>(x)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide sum or max; blockDim.x is a multiple of 32; every thread gets the result.
template <bool MAX> __device__ float block_reduce(float v) {
    __shared__ float partial[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = MAX ? warp_max(v) : warp_sum(v);
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    v = lane < warps ? partial[lane] : (MAX ? -KEEL_INF : 0.0f);
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    return v;
}

// RMSNorm of each row of x [rows, cols], optionally of x + residual (then also written to
// sum): out = weight · round(h · rsqrt(mean(h²) + eps)), h in f32. One block per row.
template <typename T>
__device__ void rms_norm(T* out, T* sum, const T* x, const T* residual, const T* weight, int cols, float eps) {
    const long base = (long)blockIdx.x * cols;
    float squares = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float h = to_f32(x[base + c]);
        if (residual) {
            h = round_to<T>(h + to_f32(residual[base + c]));
            sum[base + c] = from_f32<T>(h);
        }
        squares += h * h;
    }
    const float inv = rsqrtf(block_reduce<false>(squares) / (float)cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        const float h = residual ? to_f32(sum[base + c]) : to_f32(x[base + c]);
        out[base + c] = from_f32<T>(to_f32(weight[c]) * round_to<T>(h * inv));
    }
}

// Rotary embedding of x [B, H, S, D] (strides in elements, the last dimension dense) into
// out [B, H, S, D] (dense): x·cos + rotate_half(x)·sin with cos, sin [B, S, D] (strides
// given). One thread per pair (d, d + D/2).
template <typename T>
__device__ void rotary(T* out, const T* x, const T* cos, const T* sin, long pairs, int heads, int seq, int dim,
                       long xb, long xh, long xs, long cb, long cs) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pairs) return;
    const int half = dim / 2;
    const int d = (int)(i % half);
    long rest = i / half;
    const int s = (int)(rest % seq);
    rest /= seq;
    const int h = (int)(rest % heads);
    const long b = rest / heads;
    const T* xr = x + b * xb + h * xh + s * xs;
    const T* c = cos + b * cb + s * cs;
    const T* n = sin + b * cb + s * cs;
    T* o = out + ((b * heads + h) * seq + s) * dim;
    const float x1 = to_f32(xr[d]), x2 = to_f32(xr[d + half]);
    o[d] = from_f32<T>(round_to<T>(x1 * to_f32(c[d])) + round_to<T>(-x2 * to_f32(n[d])));
    o[d + half] = from_f32<T>(round_to<T>(x2 * to_f32(c[d + half])) + round_to<T>(x1 * to_f32(n[d + half])));
}

// out = round(silu(gate)) · up, elementwise over n values.
template <typename T> __device__ void silu_mul(T* out, const T* gate, const T* up, long n) {
    const long i = (long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float g = to_f32(gate[i]);
    out[i] = from_f32<T>(round_to<T>(g / (1.0f + expf(-g))) * to_f32(up[i]));
}

// Values of a head one lane of decode attention holds in registers: heads of up to 32 times
// this many values take the warp-parallel value sum (launch.rs sizes shared memory for it).
#define KEEL_VALUES_PER_LANE 8

// Decode attention over a paged cache: one query token per row, keys and values read through
// the row's block table. q [heads, rows, D] (strides qh, qr; D dense); pools [kv_heads, slots,
// D] dense; tables [rows, width] int32; lens [rows] int32 (keys per row, the new one
// included); a window > 0 keeps the last `window` keys. Grid (heads, rows, splits): each
// block takes `partition` keys of one (head, row); shared memory holds the query, the scores
// and, for heads of up to 256 values, each warp's value sums. With one split the block writes
// out [heads, rows, D]; with more it writes its unnormalised output to part_out [heads, rows,
// splits, D] and (max, sum) to part_ml [heads, rows, splits, 2] for paged_reduce.
template <typename T>
__device__ void paged_decode(T* out, float* part_out, float* part_ml, const T* q, long qh, long qr, const T* kpool,
                             const T* vpool, long pool_head, const int* tables, int width, const int* lens, int rows,
                             int group, int dim, float scale, int window, int partition, int block_size) {
    extern __shared__ float smem[];
    float* qs = smem;
    float* scores = smem + dim;
    const int h = blockIdx.x, r = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const long kv = (long)(h / group) * pool_head;
    const int len = lens[r];
    const int first = window > 0 && len > window ? len - window : 0;
    const int start = first + split * partition;
    const int end = min(len, start + partition);
    const int n = max(0, end - start);
    const T* qrow = q + h * qh + r * qr;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) qs[d] = to_f32(qrow[d]) * scale;
    __syncthreads();
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    const int* table = tables + (long)r * width;
    for (int j = warp; j < n; j += warps) {
        const int key = start + j;
        const long slot = (long)table[key / block_size] * block_size + key % block_size;
        const T* k = kpool + kv + slot * dim;
        float dot = 0.0f;
        for (int d = lane; d < dim; d += 32) dot += qs[d] * to_f32(k[d]);
        dot = warp_sum(dot);
        if (lane == 0) scores[j] = dot;
    }
    __syncthreads();
    float m = -KEEL_INF;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, scores[j]);
    m = block_reduce<true>(m);
    float l = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const float p = __expf(scores[j] - m);
        scores[j] = p;
        l += p;
    }
    l = block_reduce<false>(l);
    const long row = (long)h * rows + r;
    if (dim <= 32 * KEEL_VALUES_PER_LANE) {
        // The values as the keys: each warp takes every warps-th key, its lanes over the
        // head's values (a few registers each), so the warps read their keys' values side by
        // side; then the warps' sums are added through shared memory (after the scores).
        float acc[KEEL_VALUES_PER_LANE];
#pragma unroll
        for (int i = 0; i < KEEL_VALUES_PER_LANE; ++i) acc[i] = 0.0f;
        for (int j = warp; j < n; j += warps) {
            const int key = start + j;
            const long slot = (long)table[key / block_size] * block_size + key % block_size;
            const T* v = vpool + kv + slot * dim;
            const float p = scores[j];
#pragma unroll
            for (int i = 0; i < KEEL_VALUES_PER_LANE; ++i) {
                const int d = lane + 32 * i;
                if (d < dim) acc[i] += p * to_f32(v[d]);
            }
        }
        float* sums = scores + partition;
#pragma unroll
        for (int i = 0; i < KEEL_VALUES_PER_LANE; ++i) {
            const int d = lane + 32 * i;
            if (d < dim) sums[warp * dim + d] = acc[i];
        }
        __syncthreads();
        for (int d = threadIdx.x; d < dim; d += blockDim.x) {
            float total = 0.0f;
            for (int w = 0; w < warps; ++w) total += sums[w * dim + d];
            if (splits == 1) {
                out[row * dim + d] = from_f32<T>(n > 0 ? total / l : 0.0f);
            } else {
                part_out[(row * splits + split) * dim + d] = total;
            }
        }
    } else {
        // Large heads: each thread sums one value over the keys.
        for (int d = threadIdx.x; d < dim; d += blockDim.x) {
            float acc = 0.0f;
            for (int j = 0; j < n; ++j) {
                const int key = start + j;
                const long slot = (long)table[key / block_size] * block_size + key % block_size;
                acc += scores[j] * to_f32(vpool[kv + slot * dim + d]);
            }
            if (splits == 1) {
                out[row * dim + d] = from_f32<T>(n > 0 ? acc / l : 0.0f);
            } else {
                part_out[(row * splits + split) * dim + d] = acc;
            }
        }
    }
    if (splits > 1 && threadIdx.x == 0) {
        part_ml[(row * splits + split) * 2] = n > 0 ? m : -KEEL_INF;
        part_ml[(row * splits + split) * 2 + 1] = l;
    }
}

// Combines the splits of paged_decode: grid (heads, rows), threads over D.
template <typename T>
__device__ void paged_reduce(T* out, const float* part_out, const float* part_ml, int rows, int splits, int dim) {
    const long row = (long)blockIdx.x * rows + blockIdx.y;
    float m = -KEEL_INF;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, part_ml[(row * splits + s) * 2]);
    float l = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float ms = part_ml[(row * splits + s) * 2];
        if (ms > -KEEL_INF) l += part_ml[(row * splits + s) * 2 + 1] * __expf(ms - m);
    }
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const float ms = part_ml[(row * splits + s) * 2];
            if (ms > -KEEL_INF) acc += part_out[(row * splits + s) * dim + d] * __expf(ms - m);
        }
        out[row * dim + d] = from_f32<T>(l > 0.0f ? acc / l : 0.0f);
    }
}

// One entry point per kernel and type: keel_<kernel>_<f32|bf16|f16>.
#define KEEL_KERNELS(T, NAME)                                                                                   \
    extern "C" __global__ void keel_rms_norm_##NAME(T* out, T* sum, const T* x, const T* residual,              \
                                                    const T* weight, int cols, float eps) {                     \
        rms_norm<T>(out, sum, x, residual, weight, cols, eps);                                                   \
    }                                                                                                           \
    extern "C" __global__ void keel_rotary_##NAME(T* out, const T* x, const T* cos, const T* sin, long pairs,   \
                                                  int heads, int seq, int dim, long xb, long xh, long xs,       \
                                                  long cb, long cs) {                                           \
        rotary<T>(out, x, cos, sin, pairs, heads, seq, dim, xb, xh, xs, cb, cs);                                 \
    }                                                                                                           \
    extern "C" __global__ void keel_silu_mul_##NAME(T* out, const T* gate, const T* up, long n) {               \
        silu_mul<T>(out, gate, up, n);                                                                           \
    }                                                                                                           \
    extern "C" __global__ void keel_paged_decode_##NAME(                                                        \
        T* out, float* part_out, float* part_ml, const T* q, long qh, long qr, const T* kpool, const T* vpool,  \
        long pool_head, const int* tables, int width, const int* lens, int rows, int group, int dim,            \
        float scale, int window, int partition, int block_size) {                                               \
        paged_decode<T>(out, part_out, part_ml, q, qh, qr, kpool, vpool, pool_head, tables, width, lens, rows,   \
                        group, dim, scale, window, partition, block_size);                                       \
    }                                                                                                           \
    extern "C" __global__ void keel_paged_reduce_##NAME(T* out, const float* part_out, const float* part_ml,     \
                                                        int rows, int splits, int dim) {                        \
        paged_reduce<T>(out, part_out, part_ml, rows, splits, dim);                                              \
    }

KEEL_KERNELS(float, f32)
KEEL_KERNELS(bf16, bf16)
KEEL_KERNELS(f16, f16)
