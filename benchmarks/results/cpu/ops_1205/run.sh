#!/bin/bash
S=/work/main/benchmarks/studies/cpu_peers/cpu_peers.py
for n in 1 2; do
 for t in before after; do
  tree=/work/wt-before; [ $t = after ] && tree=/work/main
  (cd $tree && PYTHONPATH=$tree python3 $S --offline asyncstep:model=gguf asyncstep:model=gguf,fused_kernels=false --serve none --out /tmp/ops39/r2/${t}_$n.json > /tmp/ops39/r2/${t}_$n.log 2>&1)
 done
done
echo done > /tmp/ops39/r2/DONE
