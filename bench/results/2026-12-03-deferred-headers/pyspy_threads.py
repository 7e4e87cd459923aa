import sys, collections, re
# per thread: leaf function (python) distribution, line-level for the leaf
per = collections.defaultdict(collections.Counter); tot = collections.Counter()
for line in open(sys.argv[1]):
    stack, n = line.rstrip().rsplit(" ", 1); n = int(n)
    frames = stack.split(";")
    th = frames[0].split(":")[-1].strip()[:20]
    tot[th] += n
    leaf = frames[-1]
    per[th][leaf] += n
for th in tot:
    print(f"== {th} total {tot[th]}")
    for k, v in per[th].most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 25):
        print(f"  {100*v/tot[th]:5.1f}% {k}")
