import os, sys, runpy
sys.path.insert(0, os.getcwd())
import kvtier.store.placement as P
if os.environ.get("TXN"):
    P.DISK_TXN_BYTES = int(os.environ["TXN"]) << 20
sys.argv = ["bench/transfers.py"] + sys.argv[1:]
runpy.run_path("bench/transfers.py", run_name="__main__")
