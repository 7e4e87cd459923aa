import numpy as np, timeit
n=64
out = np.empty((30,2,3,n,16,256), np.uint8); slots = np.empty((n+8,30,2,3,16,256), np.uint8)
a, b = out[..., :1, :1][:, :, :, 5], slots[..., :1, :1][5]
print("5-D copyto 180 x 1B", timeit.timeit(lambda: np.copyto(a, b), number=100000)*10, "us")
o2 = out.reshape(180, n, 4096)[:, :, :1]; s2 = slots.reshape(n + 8, 180, 4096)[:, :, :1]
a2, b2 = o2[:, 5], s2[5]
print("2-D copyto 180 x 1B", timeit.timeit(lambda: np.copyto(a2, b2), number=100000)*10, "us")
print("2-D index+copyto", timeit.timeit(lambda: np.copyto(o2[:, 5], s2[5]), number=100000)*10, "us")
print("5-D index+copyto", timeit.timeit(lambda: np.copyto(out[..., :1, :1][:, :, :, 5], slots[..., :1, :1][5]), number=100000)*10, "us")
a3, b3 = o2[:, 5:7], s2[5:7].transpose(1, 0, 2)
print("2 blocks 3-D copyto", timeit.timeit(lambda: np.copyto(a3, b3), number=100000)*10, "us")
