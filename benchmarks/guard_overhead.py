"""Overhead of the input guard of ``random_feature_attention`` (issue 17): the same call with
the guard and with it replaced by identity, measured in the same run (one thread, median of 9).

    python benchmarks/guard_overhead.py
"""
import time, torch, hf_rfa
import hf_rfa.ops.attention as att
torch.manual_seed(0); torch.set_num_threads(1)
B,H,N,D=1,8,2048,64
q,k,v=(torch.randn(B,H,N,D) for _ in range(3))
pad=torch.ones(B,N,dtype=torch.bool); pad[:, :16]=False
fm=hf_rfa.build_feature_map("favor+", head_dim=D, num_features=64, seed=0)
real=att.guard_inputs
def t(f, r=9):
    f(); ts=[]
    for _ in range(r):
        s=time.perf_counter(); f(); ts.append(time.perf_counter()-s)
    return sorted(ts)[r//2]
with torch.no_grad():
    for name, m in (("no mask", None), ("all-ones mask", torch.ones(B,N,dtype=torch.bool)), ("16 padded", pad)):
        call=lambda: hf_rfa.random_feature_attention(q,k,v,fm,causal=True,attention_mask=m)
        att.guard_inputs = lambda q,k,v,km,c: (q,k,v,None); base=t(call)
        att.guard_inputs = real; full=t(call)
        print(f"{name}: without guard {base*1e3:.1f} ms, with guard {full*1e3:.1f} ms, ratio {full/base:.3f}")
