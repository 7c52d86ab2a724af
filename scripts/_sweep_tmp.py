"""Temporary: tile sweep for paged attention (not part of the project)."""
import itertools, math, sys, time
import torch
from triton.testing import do_bench
sys.path.insert(0, "scripts")
import gpu_kernels_check as g
from ninfer_kernels.triton import paged_attention as pa

gen = torch.Generator().manual_seed(0)
orig_tiles, orig_splits = pa._tiles, pa._num_splits

def setup(specs):
    batch, nb = g.make_batch(specs, gen)
    k = torch.randn(nb, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(sum(n for _, n in specs), 32, 128, device="cuda", dtype=torch.bfloat16)
    return q, k, v, batch

def run(q, k, v, batch, splits=None):
    return do_bench(g.graphed(lambda: pa.paged_attention(q, k, v, batch, 0.088, num_splits=splits)), warmup=10, rep=40, return_mode="median")

t0 = time.time()
dec = {f"b{b}c{c}": setup([(c - 1, 1)] * b) for b in (1, 8, 32, 64) for c in (512, 2048, 8192)}
print("decode split sweep (default tiles): us per splits value")
for name, args in dec.items():
    row = []
    for s in (1, 2, 4, 8, 16, 32, 64):
        row.append(f"{s}:{run(*args, splits=s)*1e3:.0f}")
    print(name, "default", orig_splits(args[3].seq_lens.shape[0] * 8, args[3].max_seq_len, args[0].device), " ".join(row), flush=True)
print("decode tile sweep (heuristic splits)")
for bn, w, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3)):
    pa._tiles = lambda group, mql, hd, bn=bn, w=w, st=st: (16, 1, bn, w, st)
    try:
        row = [f"{run(*a)*1e3:.0f}" for a in dec.values()]
    except Exception as e:
        row = [type(e).__name__]
    print(f"BN={bn} w={w} st={st}:", " ".join(row), flush=True)
pa._tiles = orig_tiles
pre = {"p2k": setup([(0, 2048)]), "p8k": setup([(0, 8192)]), "c2k6k": setup([(6144, 2048)])}
flops = {"p2k": 4*32*128*2048*2049/2, "p8k": 4*32*128*8192*8193/2, "c2k6k": 4*32*128*(2048*6144+2048*2049/2)}
print("prefill tile sweep: TFLOP/s")
for bm, bn, w, st in [(128,32,8,2), (128,64,4,3), (128,64,8,2), (128,128,8,2), (128,128,8,3), (64,64,4,2), (64,32,4,2), (128,32,4,3), (64,64,4,3), (128,64,8,3)]:
    pa._tiles = lambda group, mql, hd, bm=bm, bn=bn, w=w, st=st: (bm, bm // group, bn, w, st)
    try:
        row = [f"{flops[n] / run(*a, splits=1) / 1e9:.0f}" for n, a in pre.items()]
    except Exception as e:
        row = [type(e).__name__]
    print(f"BM={bm} BN={bn} w={w} st={st}:", " ".join(row), flush=True)
print(f"sweep {time.time()-t0:.0f}s")
