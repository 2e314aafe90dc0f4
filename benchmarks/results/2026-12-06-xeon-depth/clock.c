// The effective core clock: a chain of dependent imul (3 cycles each on x86 cores) timed
// with CLOCK_MONOTONIC, on argv[1] threads at once. cc -O2 -pthread clock.c && ./a.out 2
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}
static void* run(void* arg) {
  const long n = 2000000000L;
  long x = 1;
  long one = 1;
  double t0 = now();
  for (long i = 0; i < n; i += 8) {
    __asm__ volatile(
        "imul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul %1, %0\n\timul "
        "%1, %0"
        : "+r"(x)
        : "r"(one));
  }
  double t = now() - t0;
  printf("%.3f GHz (x=%ld)\n", 3.0 * n / t / 1e9, x);
  return NULL;
}
int main(int argc, char** argv) {
  int nt = argc > 1 ? atoi(argv[1]) : 1;
  pthread_t th[16];
  for (int i = 0; i < nt; ++i) pthread_create(&th[i], NULL, run, NULL);
  for (int i = 0; i < nt; ++i) pthread_join(th[i], NULL);
  return 0;
}
