/* Counts the GPU kernels a process runs, through CUPTI's activity API
 * (graph-launched kernels included, which is how MLX's CUDA backend
 * launches them). Preload it and read the count on stderr at exit:
 *
 *   cc -shared -fPIC -O2 -I$CUPTI/include -I$CUDA/include kcount.c \
 *      -L$CUPTI/lib -lcupti -o libkcount.so
 *   LD_PRELOAD=./libkcount.so ./mlex bench ...   # "kcount: N kernels"
 *
 * Used by xtask/gpu/ to count kernels per decode token: the difference of
 * two runs that differ only in the number of generated tokens. */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>

static unsigned long long kernels = 0;

static void CUPTIAPI requested(uint8_t **buf, size_t *size, size_t *max) {
  *size = 8 << 20;
  *buf = (uint8_t *)aligned_alloc(8, *size);
  *max = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buf,
                               size_t size, size_t valid) {
  CUpti_Activity *rec = NULL;
  while (cuptiActivityGetNextRecord(buf, valid, &rec) == CUPTI_SUCCESS) {
    if (rec->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
        rec->kind == CUPTI_ACTIVITY_KIND_KERNEL)
      kernels++;
  }
  free(buf);
}

__attribute__((constructor)) static void start(void) {
  cuptiActivityRegisterCallbacks(requested, completed);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
}

__attribute__((destructor)) static void stop(void) {
  cuptiActivityFlushAll(1);
  fprintf(stderr, "kcount: %llu kernels\n", kernels);
}
