import glob, sys
from asyncstep.logging.trace import load_spans
sp = load_spans(glob.glob(sys.argv[1] + "/*"))
a, b = int(sys.argv[2]), int(sys.argv[3])
sel = [s for s in sp if s.step is not None and a <= s.step <= b]
t0 = min(s.ts_us for s in sel)
for s in sorted(sel, key=lambda s: s.ts_us):
    print(f"{(s.ts_us-t0)/1000:8.2f} {s.dur_us/1000:7.2f} r{s.rank} {s.task:8s} {s.name:12s} step{s.step}")
