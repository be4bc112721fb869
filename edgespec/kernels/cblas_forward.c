/* MLX's CPU backend on Linux makes three CBLAS calls: cblas_sgemm, cblas_dgemm and
 * cblas_cgemm (every matmul; its LAPACK calls go to its own bundled library). Preloaded
 * with LD_PRELOAD, this library answers them with the OpenBLAS that numpy ships, so one
 * OpenBLAS (one thread pool) serves MLX's products and numpy's, and MLX gets that
 * build's few-row kernels. Built and checked by edgespec/kernels/cpu_blas.py, which
 * sets the target's file, symbol names and integer width:
 *   FWD_LIBRARY: the path of numpy's OpenBLAS;
 *   FWD_PREFIX, FWD_SUFFIX: scipy-openblas64 names cblas_sgemm "scipy_cblas_sgemm64_";
 *   FWD_INT: the target's BLAS integer (int64_t for an ILP64 build).
 * The CBLAS enums (order, transpose) are plain ints in the C ABI.
 *
 * The target is opened here, in a constructor, not linked: OpenBLAS reads its settings
 * from the environment when it is loaded, and OPENBLAS_THREAD_TIMEOUT (unless already
 * set) must be in place first. A pool worker spins for 2^28 cycles after each call by
 * default, and with one pool for both libraries that spin took a core from numpy's
 * attention blocks running next (an 8,190-token prefill 1.17x Debian's time with the
 * default wait, 0.96x with this one: benchmarks/blas_preload.py, docs/prefill.md).
 * If the target cannot be opened (numpy upgraded under a built shim), one warning, and
 * each call goes to the definition another loaded library has (MLX's bundled BLAS:
 * slow, correct), found at the first call, once MLX is loaded.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cblas_skinny.h" /* few-row products: sk_gemm */

#ifndef FWD_PREFIX
#define FWD_PREFIX
#endif
#ifndef FWD_SUFFIX
#define FWD_SUFFIX
#endif
#ifndef FWD_INT
#define FWD_INT int
#endif
#ifndef FWD_THREAD_TIMEOUT
#define FWD_THREAD_TIMEOUT "4"
#endif
#ifndef FWD_LIBRARY
#error "FWD_LIBRARY (the OpenBLAS to forward to) is required"
#endif

#define FWD_CAT3(a, b, c) a##b##c
#define FWD_NAME3(a, b, c) FWD_CAT3(a, b, c)
#define FWD(name) FWD_NAME3(FWD_PREFIX, name, FWD_SUFFIX)

#define FWD_STR(x) #x
#define FWD_XSTR(x) FWD_STR(x)

typedef FWD_INT fwd_int;
typedef void (*sgemm_t)(int, int, int, fwd_int, fwd_int, fwd_int, float, const float *, fwd_int,
                        const float *, fwd_int, float, float *, fwd_int);
typedef void (*dgemm_t)(int, int, int, fwd_int, fwd_int, fwd_int, double, const double *, fwd_int,
                        const double *, fwd_int, double, double *, fwd_int);
typedef void (*cgemm_t)(int, int, int, fwd_int, fwd_int, fwd_int, const void *, const void *, fwd_int,
                        const void *, fwd_int, const void *, void *, fwd_int);
/* The other definitions (MLX's bundled BLAS): 32-bit integers, unprefixed. */
typedef void (*sgemm32_t)(int, int, int, int, int, int, float, const float *, int, const float *, int,
                          float, float *, int);
typedef void (*dgemm32_t)(int, int, int, int, int, int, double, const double *, int, const double *,
                          int, double, double *, int);
typedef void (*cgemm32_t)(int, int, int, int, int, int, const void *, const void *, int, const void *,
                          int, const void *, void *, int);

static sgemm_t fwd_sgemm;
static dgemm_t fwd_dgemm;
static cgemm_t fwd_cgemm;
static sgemm32_t next_sgemm;
static dgemm32_t next_dgemm;
static cgemm32_t next_cgemm;

__attribute__((constructor)) static void fwd_init(void) {
    setenv("OPENBLAS_THREAD_TIMEOUT", FWD_THREAD_TIMEOUT, 0);
    void *lib = dlopen(FWD_LIBRARY, RTLD_NOW | RTLD_LOCAL);
    if (lib) {
        fwd_sgemm = (sgemm_t)dlsym(lib, FWD_XSTR(FWD(cblas_sgemm)));
        fwd_dgemm = (dgemm_t)dlsym(lib, FWD_XSTR(FWD(cblas_dgemm)));
        fwd_cgemm = (cgemm_t)dlsym(lib, FWD_XSTR(FWD(cblas_cgemm)));
    }
    if (!fwd_sgemm || !fwd_dgemm || !fwd_cgemm) {
        fprintf(stderr, "edgespec cblas shim: cannot use %s (%s); MLX's own BLAS answers instead "
                        "(rebuild: make setup)\n", FWD_LIBRARY, lib ? "symbols missing" : dlerror());
        fwd_sgemm = NULL, fwd_dgemm = NULL, fwd_cgemm = NULL;
    }
}

/* For the build's check: the library the calls go to, or NULL when they fall back. */
__attribute__((visibility("default"))) const char *edgespec_cblas_target(void) {
    return fwd_sgemm ? FWD_LIBRARY : NULL;
}

/* dl_iterate_phdr callback: the first loaded object, other than this one, that defines
 * the name in `data[0]`; its address goes to data[1]. */
static int other_definition(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    void **io = data;
    if (!info->dlpi_name || !info->dlpi_name[0]) return 0;
    void *h = dlopen(info->dlpi_name, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return 0;
    void *sym = dlsym(h, (const char *)io[0]);
    dlclose(h);
    Dl_info self;
    if (!sym || (dladdr(sym, &self) && self.dli_fbase == (void *)io[2])) return 0;
    io[1] = sym;
    return 1;
}

static void *find_other(const char *name) {
    Dl_info self;
    dladdr((void *)&other_definition, &self);
    void *io[3] = {(void *)name, NULL, self.dli_fbase};
    dl_iterate_phdr(other_definition, io);
    if (!io[1]) {
        fprintf(stderr, "edgespec cblas shim: no library in this process defines %s\n", name);
        abort();
    }
    return io[1];
}

__attribute__((visibility("default"))) void cblas_sgemm(
    int order, int ta, int tb, int m, int n, int k, float alpha, const float *a, int lda,
    const float *b, int ldb, float beta, float *c, int ldc) {
    if (sk_gemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)) return;
    if (fwd_sgemm) fwd_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else {
        if (!next_sgemm) next_sgemm = (sgemm32_t)find_other("cblas_sgemm");
        next_sgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
}

__attribute__((visibility("default"))) void cblas_dgemm(
    int order, int ta, int tb, int m, int n, int k, double alpha, const double *a, int lda,
    const double *b, int ldb, double beta, double *c, int ldc) {
    if (fwd_dgemm) fwd_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else {
        if (!next_dgemm) next_dgemm = (dgemm32_t)find_other("cblas_dgemm");
        next_dgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
}

__attribute__((visibility("default"))) void cblas_cgemm(
    int order, int ta, int tb, int m, int n, int k, const void *alpha, const void *a, int lda,
    const void *b, int ldb, const void *beta, void *c, int ldc) {
    if (fwd_cgemm) fwd_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    else {
        if (!next_cgemm) next_cgemm = (cgemm32_t)find_other("cblas_cgemm");
        next_cgemm(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    }
}
