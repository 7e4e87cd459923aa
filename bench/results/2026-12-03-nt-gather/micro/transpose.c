#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <sys/mman.h>
#include <immintrin.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void *huge(size_t n){void*p=aligned_alloc(2<<20,(n+(2<<20)-1)/(2<<20)*(2<<20));madvise(p,n,MADV_HUGEPAGE);memset(p,1,n);return p;}
static void nt_copy(char*d,const char*s,size_t n){for(size_t i=0;i<n;i+=32){__m256i v=_mm256_loadu_si256((const __m256i*)(s+i));_mm256_stream_si256((__m256i*)(d+i),v);}}
int main(int argc,char**argv){
  int n=argc>1?atoi(argv[1]):64; size_t rows=180, chunk=4096, total=rows*n*chunk;
  char*pool=huge(total+64*rows*chunk), *out=huge(total), *a=huge(total), *b=huge(total);
  double best[5]={1e9,1e9,1e9,1e9,1e9};
  for(int rep=0;rep<15;rep++){
    double t=now(); memcpy(b,a,total); t=now()-t; if(t<best[0])best[0]=t;
    t=now(); for(int i=0;i<n;i++) for(size_t r=0;r<rows;r++) memcpy(out+(r*n+i)*chunk, pool+((size_t)(3+i)*rows+r)*chunk, chunk); t=now()-t; if(t<best[1])best[1]=t;
    t=now(); for(size_t r=0;r<rows;r++) for(int i=0;i<n;i++) memcpy(out+(r*n+i)*chunk, pool+((size_t)(3+i)*rows+r)*chunk, chunk); t=now()-t; if(t<best[2])best[2]=t;
    t=now(); for(int i=0;i<n;i++) for(size_t r=0;r<rows;r++) nt_copy(out+(r*n+i)*chunk, pool+((size_t)(3+i)*rows+r)*chunk, chunk); _mm_sfence(); t=now()-t; if(t<best[3])best[3]=t;
    t=now(); for(size_t r=0;r<rows;r++) for(int i=0;i<n;i++) nt_copy(out+(r*n+i)*chunk, pool+((size_t)(3+i)*rows+r)*chunk, chunk); _mm_sfence(); t=now()-t; if(t<best[4])best[4]=t;
  }
  printf("n=%d memcpy %.2f ms; block-major memcpy gather %.2f (%.2fx); row-major %.2f (%.2fx); block-major NT %.2f (%.2fx); row-major NT %.2f (%.2fx)\n", n,
    best[0]*1e3,best[1]*1e3,best[1]/best[0],best[2]*1e3,best[2]/best[0],best[3]*1e3,best[3]/best[0],best[4]*1e3,best[4]/best[0]);
}
