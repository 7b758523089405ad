/* Read rate of 2 threads over 538 MB of float32 weights (the SmolLM2 F32 copy's size),
 * each row dotted with an L1-resident vector as the F32 GEMV does, in several access
 * patterns: one sequential stream a thread (the GEMV's), 2 or 4 streams a thread advancing
 * together, software prefetch 512-2048 floats ahead. Rounds interleave the patterns, so a
 * machine whose memory speed drifts moves them alike. Prints GB/s per pattern per round
 * (docs/benchmarks.md, 2026-11-25: is the F32 GEMV at the machine's read rate?).
 *
 *     gcc -O3 -march=native -pthread benchmarks/read_patterns.c -o /tmp/read_patterns
 *     /tmp/read_patterns 6        # rounds
 */
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#define K 576
static float *W; static long N; static float X[4096]; static volatile float sink[64];
static int pattern, pf_dist;
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static inline float dot1(const float*w,const float*x){__m512 a0=_mm512_setzero_ps(),a1=a0,a2=a0,a3=a0;
 for(int k=0;k+64<=K;k+=64){
  if(pf_dist){_mm_prefetch((const char*)(w+k+pf_dist),_MM_HINT_T0);_mm_prefetch((const char*)(w+k+pf_dist+32),_MM_HINT_T0);}
  a0=_mm512_fmadd_ps(_mm512_loadu_ps(w+k),_mm512_loadu_ps(x+k),a0);a1=_mm512_fmadd_ps(_mm512_loadu_ps(w+k+16),_mm512_loadu_ps(x+k+16),a1);
  a2=_mm512_fmadd_ps(_mm512_loadu_ps(w+k+32),_mm512_loadu_ps(x+k+32),a2);a3=_mm512_fmadd_ps(_mm512_loadu_ps(w+k+48),_mm512_loadu_ps(x+k+48),a3);}
 return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0,a1),_mm512_add_ps(a2,a3)));}
typedef struct{long n0,n1;int id;}arg_t;
static void* work(void*p){arg_t*a=p;float s=0;
 if(pattern==0){ for(long n=a->n0;n<a->n1;n++) s+=dot1(W+n*K,X); }
 else { // pattern = S streams: split the thread's rows into S contiguous parts, advance them together
  int S=pattern; long len=(a->n1-a->n0)/S;
  for(long i=0;i<len;i++) for(int j=0;j<S;j++) s+=dot1(W+(a->n0+j*len+i)*K,X);
  for(long n=a->n0+S*len;n<a->n1;n++) s+=dot1(W+n*K,X);}
 sink[a->id*16]=s;return 0;}
static double run(void){pthread_t t[2];arg_t a[2];double t0=now();
 for(int i=0;i<2;i++){a[i].n0=N*i/2;a[i].n1=N*(i+1)/2;a[i].id=i;pthread_create(&t[i],0,work,&a[i]);}
 for(int i=0;i<2;i++)pthread_join(t[i],0);return (double)N*K*4/(now()-t0)/1e9;}
int main(int argc,char**argv){N=538000000L/(K*4);size_t bytes=(size_t)N*K*4;
 W=aligned_alloc(2<<20,(bytes+(2<<20)-1)/(2<<20)*(2<<20));madvise(W,bytes,MADV_HUGEPAGE);
 for(size_t i=0;i<(size_t)N*K;i++)W[i]=(float)(i%7)*0.1f;for(int i=0;i<4096;i++)X[i]=1.0f/(i+1);
 int pats[][2]={{0,0},{2,0},{4,0},{0,512},{0,1024},{0,2048},{4,1024}};int np=sizeof pats/sizeof pats[0];
 double r[16][16];int rounds=atoi(argv[1]);
 for(int k=0;k<rounds;k++)for(int p=0;p<np;p++){pattern=pats[p][0];pf_dist=pats[p][1];run();r[p][k]=run();}
 for(int p=0;p<np;p++){printf("streams %d prefetch %4d floats:",pats[p][0]?pats[p][0]:1,pats[p][1]);
  for(int k=0;k<rounds;k++)printf(" %5.1f",r[p][k]);printf("\n");}}
