from kvtier.records import _header_for, check_record
acc = {"h": [], "c": []}
def mk(chunk):
    def run():
        th = tc = 0.0
        pc = time.perf_counter
        with disk.env.begin(buffers=True) as txn:
            for h, v, f in zip(hashes, views, fps):
                value = txn.get(h)
                record = _header_for(value, ns, v)
                digest = record.digest(value)
                src = np.frombuffer(value, dtype=np.uint8, offset=HEADER_NBYTES)
                dst = v.view(torch.uint8).numpy()
                rows = src.reshape(dst.shape)
                row_nbytes = record.payload_nbytes // v.shape[0]
                step = max(1, chunk // row_nbytes)
                for first in range(0, v.shape[0], step):
                    t0 = pc()
                    digest.update(src[first * row_nbytes : (first + step) * row_nbytes])
                    t1 = pc()
                    np.copyto(dst[first : first + step], rows[first : first + step])
                    tc += pc() - t1; th += t1 - t0
        acc["h"].append(th); acc["c"].append(tc)
    return run
def cold_hot():
    # copy_views with source pre-hashed whole (hot in L3?) vs not
    pass
EXTRA = {"hf192K_t": mk(192 << 10)}
import atexit
atexit.register(lambda: print("hash ms", [round(x*1e3,2) for x in acc["h"]], "copy ms", [round(x*1e3,2) for x in acc["c"]]))
