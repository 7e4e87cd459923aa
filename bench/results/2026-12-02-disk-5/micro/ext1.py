from kvtier.records import _header_for, check_record
def mk(chunk, order="hash_first"):
    def run():
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
                if order == "hash_first":
                    for first in range(0, v.shape[0], step):
                        digest.update(src[first * row_nbytes : (first + step) * row_nbytes])
                        np.copyto(dst[first : first + step], rows[first : first + step])
                elif order == "copy_first":
                    for first in range(0, v.shape[0], step):
                        np.copyto(dst[first : first + step], rows[first : first + step])
                        digest.update(src[first * row_nbytes : (first + step) * row_nbytes])
                else:  # unfused
                    digest.update(src)
                    np.copyto(dst, rows)
                assert check_record(record, digest.intdigest(), f).value == "ok"
    return run
EXTRA = {f"hf{c>>10}K": mk(c) for c in (24 << 10, 48 << 10, 96 << 10, 192 << 10, 512 << 10)}
EXTRA["cf96K"] = mk(96 << 10, "copy_first")
EXTRA["unfused"] = mk(0, "unfused")
