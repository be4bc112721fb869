"""Cost of one EAGLE-3 head step per drafted token (and per level of its dynamic tree) beside one
verifier pass over one token, with random weights shaped like SmolLM2-360M (the verifier) and a
one-layer head with a 16384-token draft vocabulary (acceptance of a random head means nothing; its cost does).

    LD_PRELOAD=$(make -s preload) .venv/bin/python benchmarks/eagle3_cost.py
"""

import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from conftest import make_tiny_tokenizer  # noqa: E402
from edgespec.models.eagle3 import Model, ModelArgs  # noqa: E402
from edgespec.models.llama import Model as LM  # noqa: E402
from edgespec.models.llama import ModelArgs as LA  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import edgespec  # noqa: E402
from edgespec.logits.sampling import Sampler, SamplingParams  # noqa: E402

tmp = Path(tempfile.mkdtemp())
vcfg = dict(model_type="llama", hidden_size=960, num_hidden_layers=32, intermediate_size=2560, num_attention_heads=15,
            num_key_value_heads=5, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
            max_position_embeddings=8192)
mx.random.seed(0)
vm = LM(LA.from_dict(vcfg))
(tmp / "v").mkdir()
(tmp / "v" / "config.json").write_text(json.dumps(vcfg))
mx.save_safetensors(str(tmp / "v" / "model.safetensors"), dict(tree_flatten(vm.parameters())))
make_tiny_tokenizer(64).save(tmp / "v")
Vd = 16384
layer = dict(vcfg, num_hidden_layers=1)
cfg = dict(speculators_model_type="eagle3", transformer_layer_config=layer, draft_vocab_size=Vd,
           eagle_aux_hidden_state_layer_ids=[2, 16, 29], speculators_config={"algorithm": "eagle3"})
head = Model(ModelArgs.from_dict(cfg))
w = dict(tree_flatten(head.parameters()))
tids = np.sort(np.random.RandomState(0).choice(49152, Vd, replace=False))
w["d2t"] = mx.array(tids - np.arange(Vd), dtype=mx.int64)
(tmp / "h").mkdir()
mx.save_safetensors(str(tmp / "h" / "model.safetensors"), w)
(tmp / "h" / "config.json").write_text(json.dumps(cfg))
engine = edgespec.load(tmp / "v", drafter=tmp / "h", progress=False, history="off")
m, d = engine.model, engine.drafter.fork()
prompt = [int(t) for t in np.random.RandomState(1).randint(1, 49152, size=200)]
cache = m.make_cache()
d.bind_verifier_cache(cache)
mx.eval(m(mx.array([prompt]), cache))
d.begin(prompt + [5])
s = Sampler(SamplingParams(temperature=0.0))


def timeit(fn, n=30):
    fn()
    fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def verifier_step():
    out = m(mx.array([[5]]), cache)
    mx.eval(out)
    for c in cache:
        c.trim(1)


def draft(k):
    def f():
        d.fed = len(d.seq) - 1  # the context is fed: time the chain alone
        d.draft(k, s)
    return f


d.draft(1, s)
tv = timeit(verifier_step)
t1, t5 = timeit(draft(1)), timeit(draft(5))
per_tok = (t5 - t1) / 4
print(f"verifier pass (1 token, ctx 200): {tv*1e3:.2f} ms; head: first drafted token {t1*1e3:.2f} ms "
      f"(re-feeds the last entry), each further one {per_tok*1e3:.2f} ms = {per_tok/tv:.3f} of a pass")
hp = sum(v.size for k, v in tree_flatten(head.parameters()))
vp = sum(v.size for k, v in tree_flatten(vm.parameters()))
print(f"weights read: head {hp/1e6:.1f}M params, verifier {vp/1e6:.1f}M ({hp/vp:.3f})")


def tree(depth, width=3, topk=3):
    def f():
        d.fed = len(d.seq) - 1  # as for the chain: the tree alone
        d.draft_tree(depth, width, topk)
    return f


tt1, tt5 = timeit(tree(1)), timeit(tree(5))
per_level = (tt5 - tt1) / 4
print(f"dynamic tree (width 3, topk 3): first level {tt1*1e3:.2f} ms, each further level (3 nodes in one head call) "
      f"{per_level*1e3:.2f} ms = {per_level/tv:.3f} of a pass, {per_level/per_tok:.2f} chain steps")
