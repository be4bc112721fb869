/* MLX's CPU backend on Linux makes three CBLAS calls: cblas_sgemm, cblas_dgemm and
 * cblas_cgemm (every matmul; its LAPACK calls go to its own bundled library). Preloaded
 * with LD_PRELOAD, this library answers them with the OpenBLAS that numpy ships, so one
 * OpenBLAS (one thread pool) serves MLX's products and numpy's, and MLX gets that
 * build's few-row kernels. Built and checked by edgespec/kernels/cpu_blas.py, which
 * sets the target's symbol names and integer width:
 *   FWD_PREFIX, FWD_SUFFIX: scipy-openblas64 names cblas_sgemm "scipy_cblas_sgemm64_";
 *   FWD_INT: the target's BLAS integer (int64_t for an ILP64 build).
 * The CBLAS enums (order, transpose) are plain ints in the C ABI.
 */
#include <stdint.h>

#ifndef FWD_PREFIX
#define FWD_PREFIX
#endif
#ifndef FWD_SUFFIX
#define FWD_SUFFIX
#endif
#ifndef FWD_INT
#define FWD_INT int
#endif

#define FWD_CAT3(a, b, c) a##b##c
#define FWD_NAME3(a, b, c) FWD_CAT3(a, b, c)
#define FWD(name) FWD_NAME3(FWD_PREFIX, name, FWD_SUFFIX)

typedef FWD_INT fwd_int;

void FWD(cblas_sgemm)(int, int, int, fwd_int, fwd_int, fwd_int, float, const float *, fwd_int,
                      const float *, fwd_int, float, float *, fwd_int);
void FWD(cblas_dgemm)(int, int, int, fwd_int, fwd_int, fwd_int, double, const double *, fwd_int,
                      const double *, fwd_int, double, double *, fwd_int);
void FWD(cblas_cgemm)(int, int, int, fwd_int, fwd_int, fwd_int, const void *, const void *, fwd_int,
                      const void *, fwd_int, const void *, void *, fwd_int);

__attribute__((visibility("default"))) void cblas_sgemm(
    int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
    const float *b, int ldb, float beta, float *c, int ldc) {
    FWD(cblas_sgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

__attribute__((visibility("default"))) void cblas_dgemm(
    int order, int ta, int tb, int m, int n, int k, double alpha, const double *a, int lda,
    const double *b, int ldb, double beta, double *c, int ldc) {
    FWD(cblas_dgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

__attribute__((visibility("default"))) void cblas_cgemm(
    int order, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int lda,
    const void *b, int ldb, const void *beta, void *c, int ldc) {
    FWD(cblas_cgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
