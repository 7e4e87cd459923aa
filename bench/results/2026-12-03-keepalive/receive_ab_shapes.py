"""receive_ab.py (bench/results/2026-12-03-receive) on other shapes (block KiB, blocks per put):
edit SHAPES; argv: [PAIRS] [ROUNDS] (default 3 5). Run from the tree root."""
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "bench/results/2026-12-03-receive"))
import receive_ab  # noqa: E402

receive_ab.SHAPES = [(256, 4), (256, 8), (512, 2), (512, 4), (1024, 1), (1024, 2), (2048, 1)]
sys.argv = [sys.argv[0], *(sys.argv[1:] or ["3", "5"])]
receive_ab.main()
