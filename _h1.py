import jax, re, collections, sys
from zerojax._src import search, report as report_lib
topo = 'v5e:2x4'
t = search.make_target('gpt2-small', topo, devices=None, optimizer=None, mixed_precision=True, seq_len=256) if False else None
from zerojax._src import tpu
import optax
target = search.make_target('gpt2-small', topo, devices=tpu.topology_devices(topo), optimizer=lambda: optax.adamw(1e-4), mixed_precision=True, seq_len=256, compute_dtype='bfloat16', attention_chunk=None)
c = search.Candidate(3, 'flat', 1, 'full', sys.argv[1] == 'on', 'opt_state+master', sys.argv[2])
traced, plan, state, batch, unit = search.lower_candidate(target, c)
compiled, text = report_lib.compile_with_text(traced.lower())
open('/zerojax/_h1.txt' if __import__('os').path.exists('/zerojax') else '/work/main/_h1.txt', 'w').write(text)
m = compiled.memory_analysis()
print('temp', m.temp_size_in_bytes/2**20, 'args', m.argument_size_in_bytes/2**20, 'host args', m.host_argument_size_in_bytes/2**20)
ops = collections.Counter()
for l in text.splitlines():
  if 'S(5)' in l:
    mm = re.search(r'= \S+ ([a-z\-]+)\(', l) or re.search(r'\) ([a-z\-]+)\(', l)
    ops[mm.group(1) if mm else '?'] += 1
print(ops)
