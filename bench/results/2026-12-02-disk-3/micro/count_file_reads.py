# How often the file path engages in cold reads (readpath.py auto_cold): 0 of 384 on the test VM.
import runpy, sys, os
sys.argv=["x","auto_cold","auto_cold"]; os.environ["REPS"]="1"
from kvtier.tiers import disk as D
n={"file":0,"probe":0}
o=D.decode_file_into
def f(*a):
    n["file"]+=1; return o(*a)
D.decode_file_into=f
oc=D._MappedFile.cold_offset
def c(self,v):
    n["probe"]+=1; return oc(self,v)
D._MappedFile.cold_offset=c
try:
    runpy.run_path("bench/results/2026-12-02-disk-3/micro/readpath.py")
finally:
    print(n)
