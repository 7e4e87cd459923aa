from kvtier.records import _header_for, check_record
def mk(mode):
    def run():
        with disk.env.begin(buffers=True) as txn:
            for i, (h, f) in enumerate(zip(hashes, fps)):
                value = txn.get(h); out = pool[i]
                record = _header_for(value, ns, out)
                digest = record.digest(value)
                src = np.frombuffer(value, dtype=np.uint8, offset=HEADER_NBYTES)
                dst = out.view(torch.uint8).numpy().reshape(-1)
                if mode == "hash_copy":
                    digest.update(src); np.copyto(dst, src)
                else:
                    np.copyto(dst, src); digest.update(dst)
                assert check_record(record, digest.intdigest(), f).value == "ok"
    return run
EXTRA = {"ri_hash_copy": mk("hash_copy"), "ri_copy_hashdst": mk("copy_hash")}
