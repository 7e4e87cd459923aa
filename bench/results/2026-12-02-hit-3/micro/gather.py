import time, torch, numpy as np
torch.set_num_threads(1)
L,H,B,D=30,3,16,64
def best(f, r=9):
    b=1e9
    for _ in range(r):
        t=time.perf_counter(); f(); b=min(b,time.perf_counter()-t)
    return b*1e3
for n_tok in (1024,2048,4096):
    n=n_tok//B
    pool=torch.randn(n+64, L,2,H,B,D)
    out=torch.empty(L,2,H,n,B,D); out.zero_()
    src=torch.randn(L*2*H*n*B*D); dst=torch.empty_like(src); dst.zero_()
    base=best(lambda: dst.copy_(src))
    perm=pool[3:3+n].permute(1,2,3,0,4,5)
    t_torch=best(lambda: out.copy_(perm))
    on=out.numpy(); pn=pool.numpy()
    t_np=best(lambda: np.copyto(on, pn[3:3+n].transpose(1,2,3,0,4,5)))
    def per_blk():
        for i in range(n): np.copyto(on[:,:,:,i], pn[3+i])
    t_blk=best(per_blk)
    def per_blk_t():
        for i in range(n): out[:,:,:,i].copy_(pool[3+i])
    t_blk_t=best(per_blk_t)
    o3=on.reshape(L*2*H, n, B*D); p3=pn.reshape(-1, L*2*H, B*D)
    def per_row():
        np.copyto(o3, p3[3:3+n].transpose(1,0,2))
    t_row=best(per_row)
    print(n_tok, f"base {base:.2f}ms torch {t_torch/base:.2f} np {t_np/base:.2f} np-per-blk {t_blk/base:.2f} torch-per-blk {t_blk_t/base:.2f} np-3d {t_row/base:.2f}")
