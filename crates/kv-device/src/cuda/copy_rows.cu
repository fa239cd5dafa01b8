// kvlink copy kernels: move fixed-size rows (one page slot's slice of one (component, layer))
// between a contiguous staging buffer and scattered pool slots, in one launch per
// (component, layer), never one call per page.
//
// Compiled at run time with NVRTC (kv_device::cuda::Kernels), or loaded from the PTX shipped
// beside this file (copy_rows.ptx, generated from this source by
// `scripts/gpu-build.sh --regen-ptx`) when libnvrtc is absent.
//
// Row r goes from src + (src_rows ? src_rows[r] : r) * row_bytes
//            to   dst + (dst_rows ? dst_rows[r] : r) * row_bytes.
// Grid: x covers the bytes of a row (grid-stride), y covers rows (grid-stride).

struct __align__(16) kvlink_v16 {
    unsigned int a, b, c, d;
};

extern "C" __global__ void kvlink_copy_rows(
    const unsigned char* __restrict__ src,
    unsigned char* __restrict__ dst,
    const unsigned int* __restrict__ src_rows,
    const unsigned int* __restrict__ dst_rows,
    unsigned int n_rows,
    unsigned long long row_bytes)
{
    const unsigned long long tid = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned int r = blockIdx.y; r < n_rows; r += gridDim.y) {
        const unsigned long long s = src_rows ? (unsigned long long)src_rows[r] : (unsigned long long)r;
        const unsigned long long d = dst_rows ? (unsigned long long)dst_rows[r] : (unsigned long long)r;
        const unsigned char* sp = src + s * row_bytes;
        unsigned char* dp = dst + d * row_bytes;
        if ((((unsigned long long)sp | (unsigned long long)dp | row_bytes) & 15ull) == 0ull) {
            const kvlink_v16* s16 = (const kvlink_v16*)sp;
            kvlink_v16* d16 = (kvlink_v16*)dp;
            const unsigned long long n = row_bytes >> 4;
            for (unsigned long long k = tid; k < n; k += stride) {
                d16[k] = s16[k];
            }
        } else {
            for (unsigned long long k = tid; k < row_bytes; k += stride) {
                dp[k] = sp[k];
            }
        }
    }
}
