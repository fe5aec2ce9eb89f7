#!/bin/bash
cd /work/main
export PYTHONPATH=/work/main
for n in 1 2 3; do
 for b in trio asyncio; do
  for t in 1 default; do
   opt=""; [ $t = 1 ] && opt="--engine-opt cpu_threads=1"
   python3 benchmarks/host_cpu.py --no-hf --no-spans --busy-streams --repeats 3 --busy-repeats 3 --backend $b $opt --out /tmp/busy/s_${t}_${b}_${n}.json > /tmp/busy/s_${t}_${b}_${n}.log 2>&1
  done
 done
done
echo done > /tmp/busy/DONE
