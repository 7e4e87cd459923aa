"""Top frames of a py-spy raw (folded) profile: self and inclusive shares. argv: FILE [N]."""
import collections
import sys

tot, leaf, incl = 0, collections.Counter(), collections.Counter()
for line in open(sys.argv[1]):
    stack, _, n = line.rstrip().rpartition(" ")
    n = int(n)
    tot += n
    frames = stack.split(";")
    leaf[frames[-1]] += n
    for f in set(frames):
        incl[f] += n
k = int(sys.argv[2]) if len(sys.argv) > 2 else 25
print("samples", tot)
for f, n in leaf.most_common(k):
    print(f"{100 * n / tot:5.1f}% self {f[:140]}")
for f, n in incl.most_common(k + 15):
    print(f"{100 * n / tot:5.1f}% incl {f[:140]}")
