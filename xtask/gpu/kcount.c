/* Counts the GPU kernels a process runs, through CUPTI's activity API
 * (graph-launched kernels included, which is how MLX's CUDA backend
 * launches them). Preload it and read the count on stderr at exit:
 *
 *   cc -shared -fPIC -O2 -I$CUPTI/include -I$CUDA/include kcount.c \
 *      -L$CUPTI/lib -lcupti -o libkcount.so
 *   LD_PRELOAD=./libkcount.so ./mlex bench ...   # "kcount: N kernels"
 *
 * Used by xtask/gpu/ to count kernels per decode token: the difference of
 * two runs that differ only in the number of generated tokens.
 *
 * With KCOUNT_NAMES=1 it also prints, per kernel name, the launches and the
 * summed GPU time ("kname: COUNT NS NAME"), and the GPU time of all kernels
 * ("kbusy: NS"): two runs' difference gives what one decode token runs and
 * how long the GPU is busy with it. */
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Any kernel record version: they share the prefix up to `name`. */
#ifndef KREC
#define KREC CUpti_ActivityKernel4
#endif

static unsigned long long kernels = 0;
static unsigned long long busy_ns = 0;

/* Per-name tallies: few distinct kernels run, so a linear table will do. */
#define MAX_NAMES 1024
static struct {
  char *name;
  unsigned long long count, ns;
} names[MAX_NAMES];
static int n_names = 0;

static void tally(const char *name, unsigned long long ns) {
  if (!name) name = "?";
  for (int i = 0; i < n_names; i++)
    if (strcmp(names[i].name, name) == 0) {
      names[i].count++;
      names[i].ns += ns;
      return;
    }
  if (n_names < MAX_NAMES) {
    names[n_names].name = strdup(name);
    names[n_names].count = 1;
    names[n_names].ns = ns;
    n_names++;
  }
}

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
        rec->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      kernels++;
      KREC *k = (KREC *)rec;
      unsigned long long ns = k->end > k->start ? k->end - k->start : 0;
      busy_ns += ns;
      if (getenv("KCOUNT_NAMES")) tally(k->name, ns);
    }
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
  fprintf(stderr, "kbusy: %llu\n", busy_ns);
  for (int i = 0; i < n_names; i++)
    fprintf(stderr, "kname: %llu %llu %s\n", names[i].count, names[i].ns,
            names[i].name);
}
