"""Gemma 4's assistant exported to Core ML (converters/coreml_assistant.py) on a tiny random Gemma 4
and assistant built with transformers: the saved package, executed by the numpy MIL executor,
computes what the MLX assistant computes (logits and the next hidden guess) over key/value
deltas, a rollback and a full buffer; a drafting run through the executor drafts what the MLX
assistant drafts and speculative decoding with it equals plain; `convert --drafter` writes the
package and its manifest entry, and refuses an assistant that does not fit the verifier."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("coremltools")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from coreml_support import rel_err  # noqa: E402
from test_arch_moe_gemma4 import (  # noqa: E402
    ASSISTANT_TEXT,
    SHORT,
    V,
    assistant_checkpoint,
    checkpoint,
    hf_greedy,
    teach_assistant,
)

import edgespec  # noqa: E402

CONTEXT = 48
APPENDS = (1, 4, 16)
KINDS = {"sliding": (2, 16), "full": (1, 32)}  # the tiny verifier's store layers: (key/value heads, head size)
ALLOWED_OPS = {
    "const", "reshape", "gather", "greater", "greater_equal", "less", "select", "add", "sub", "mul", "cast",
    "reduce_mean", "reduce_min", "rsqrt", "conv", "split", "concat", "slice_update", "slice_by_index", "matmul",
    "softmax", "gelu", "topk", "read_state", "coreml_update_state", "identity",
}  # fmt: skip


@pytest.fixture(scope="module")
def ordered(tmp_path_factory):
    """(verifier engine, MLX assistant, package path, info): an assistant with ordered embeddings."""
    from edgespec.converters.coreml_assistant import export_assistant

    from edgespec.drafters.assistant import load_assistant_model

    tmp = tmp_path_factory.mktemp("cml_assistant")
    checkpoint(tmp / "hf", "gemma4_text", seed=1)
    assistant_checkpoint(tmp / "assistant", seed=5, ordered=True)
    engine = edgespec.load(tmp / "hf", drafter="none", progress=False, history="off")
    assistant = load_assistant_model(tmp / "assistant")
    info = export_assistant(assistant, tmp / "drafter.mlpackage", engine.model.args, context_length=CONTEXT,
                            append_tokens=APPENDS, vocab_hash="tinyhash")
    return engine, assistant, tmp / "drafter.mlpackage", info, tmp


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """A bundle converted with a taught assistant as --drafter (Core ML package included)."""
    from edgespec.converters.convert import convert

    tmp = tmp_path_factory.mktemp("cml_assistant_bundle")
    verifier = checkpoint(tmp / "hf", "gemma4_text", seed=1)
    plain = hf_greedy(verifier, SHORT, 24)
    taught = teach_assistant(assistant_checkpoint(tmp / "assistant", seed=5, ordered=False), verifier,
                             SHORT[-1:] + plain)
    taught.save_pretrained(tmp / "assistant")
    manifest = convert(tmp / "hf", tmp / "bundle", quantize="none", dtype="float32", progress=False,
                       drafter=tmp / "assistant", drafter_options={"context_length": 2 * CONTEXT, "prefill_chunk": 16})
    return tmp / "bundle", manifest, plain


def rounded(model):
    """The model with its float weights rounded through fp16: what the package stores."""
    from mlx.utils import tree_map

    model.update(tree_map(lambda p: p.astype(mx.float16).astype(mx.float32)
                          if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))
    mx.eval(model.parameters())
    return model


def test_package_functions_inputs_outputs_and_states(ordered):
    import coremltools as ct
    from coremltools.converters.mil.mil.types import builtin_to_string
    from edgespec.converters.mil_executor import load_program

    _, _, path, info, _ = ordered
    spec = ct.models.MLModel(str(path), skip_model_load=True).get_spec()
    fns = {f.name: f for f in spec.description.functions}
    assert set(fns) == {"draft", "append_1", "append_4", "append_16"} == set(info["functions"])
    assert spec.description.defaultFunctionName == "draft"
    states = {f"{t}_{kv}": [h, d, CONTEXT] for t, (h, d) in KINDS.items() for kv in ("keys", "values")}
    assert info["states"] == states and info["kind"] == "gemma4_assistant" and info["vocab_hash"] == "tinyhash"
    for name, f in fns.items():
        assert {s.name: list(s.type.stateType.arrayType.shape) for s in f.state} == states
        ins = {i.name: list(i.type.multiArrayType.shape) for i in f.input}
        if name == "draft":
            assert ins == {"embedding": [1, 64, 1, 1], "hidden": [1, 64, 1, 1], "position": [1]}
            assert {o.name: list(o.type.multiArrayType.shape) for o in f.output} == \
                {"logits": [1, V, 1, 1], "next_hidden": [1, 64, 1, 1]}
        else:
            S = int(name.split("_")[1])
            assert ins == {"position": [1], **{f"{t}_{kv}_new": [h, d, S] for t, (h, d) in KINDS.items()
                                               for kv in ("keys", "values")}}
    _, prog = load_program(path)
    for name, fn in prog.functions.items():
        used = {op.op_type for op in fn.operations}
        assert used <= ALLOWED_OPS, f"{name}: unexpected ops {used - ALLOWED_OPS}"
    means = [op for op in prog.functions["draft"].operations if op.op_type == "reduce_mean"]
    assert len(means) == 5 * 2 + 1  # 4 norms and q's per-head norm in each of 2 layers, the final norm
    assert all(builtin_to_string(op.outputs[0].dtype) == "fp32" for op in means)  # fp16 would overflow


def _kv(rng, n: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Random store-layer keys/values (1, Hk, n, D) per short layer type."""
    return {t: tuple(rng.standard_normal((1, h, n, d)).astype(np.float32) for _ in range(2))
            for t, (h, d) in KINDS.items()}


def _append(ex, state, kv, start: int, stop: int, S: int) -> None:
    """Write positions start..stop-1 of `kv` with append_S (the window padded with zeros)."""
    inputs = {"position": np.array([start], np.int32)}
    for t, pair in kv.items():
        for name, x in zip(("keys", "values"), pair, strict=True):
            rows = x[0, :, start:stop].transpose(0, 2, 1)
            inputs[f"{t}_{name}_new"] = np.concatenate([rows, np.zeros((*rows.shape[:2], S - rows.shape[2]))], 2)
    assert ex.run(f"append_{S}", inputs, state)["end"].tolist() == [start + S]


@pytest.mark.parametrize("fp16,tol", [(False, 1e-5), (True, 1e-2)])
def test_draft_steps_match_the_mlx_assistant_over_deltas_and_a_rollback(ordered, fp16, tol):
    """Chained draft steps at several positions, the buffers filled by key/value deltas: a prompt
    in windows, a round's few positions (a padded window), a rollback to an earlier position with
    other keys and values after it (the stale slots must stay hidden), and the whole buffer."""
    from edgespec.converters.mil_executor import MILExecutor

    from edgespec.drafters.assistant import load_assistant_model

    _, _, path, _, tmp = ordered
    ref = rounded(load_assistant_model(tmp / "assistant")) if not fp16 else load_assistant_model(tmp / "assistant")
    ex = MILExecutor(path, fp16=fp16)
    state = ex.make_state("draft")
    rng = np.random.default_rng(3)
    kv = _kv(rng, CONTEXT)
    again = {t: tuple(np.concatenate([x[:, :, :12], y[:, :, 12:]], 2) for x, y in zip(kv[t], other, strict=True))
             for t, other in _kv(rng, CONTEXT).items()}  # the same first 12 positions, then others
    plan = [  # (keys/values in force, appends (start, stop, S), draft position)
        (kv, [(0, 16, 16), (16, 20, 4)], 20),
        (kv, [(20, 21, 1), (21, 23, 4)], 23),  # slots 23 and 24 get padding: masked at p = 23
        (again, [], 12),  # rollback: slots 12..24 are stale, hidden by the mask
        (again, [(12, 16, 4), (16, 18, 4)], 18),
        (again, [(18, 32, 16), (32, 48, 16)], 48),  # every slot in use
    ]
    worst, agree, steps = 0.0, 0, 0
    for cur, appends, p in plan:
        for start, stop, S in appends:
            _append(ex, state, cur, start, stop, S)
        kv_ref = {f"{t}_attention": (mx.array(a[:, :, :p]), mx.array(b[:, :, :p])) for t, (a, b) in cur.items()}
        hidden = rng.standard_normal((1, 1, 64)).astype(np.float32)
        for _ in range(3):
            emb = rng.standard_normal((1, 1, 64)).astype(np.float32) * 4.0
            logits, nxt = ref(mx.array(np.concatenate([emb, hidden], -1)), kv_ref, p)
            out = ex.run("draft", {"embedding": emb.reshape(1, 64, 1, 1), "hidden": hidden.reshape(1, 64, 1, 1),
                                   "position": np.array([p], np.int32)}, state)
            want_l, want_h = np.array(logits).reshape(-1), np.array(nxt).reshape(-1)
            got_l = np.asarray(out["logits"], np.float32).reshape(-1)
            worst = max(worst, rel_err(got_l, want_l),
                        rel_err(np.asarray(out["next_hidden"], np.float32).reshape(-1), want_h))
            agree += int(got_l.argmax() == want_l.argmax())
            steps += 1
            hidden = want_h.reshape(1, 1, 64)
    assert worst < tol, worst
    assert agree >= steps - (1 if fp16 else 0)


def test_the_package_depends_on_what_it_is_given(ordered):
    """Not a constant: other keys/values or another position change the logits; the ordered head
    leaves exactly the unchosen clusters' tokens at one fill value."""
    from edgespec.converters.mil_executor import MILExecutor

    _, assistant, path, _, _ = ordered
    ex = MILExecutor(path)
    rng = np.random.default_rng(0)
    x = {"embedding": rng.standard_normal((1, 64, 1, 1)), "hidden": rng.standard_normal((1, 64, 1, 1))}
    outs = []
    for seed, p in ((1, 20), (2, 20), (1, 19)):
        state = ex.make_state("draft")
        _append(ex, state, _kv(np.random.default_rng(seed), CONTEXT), 0, 16, 16)
        _append(ex, state, _kv(np.random.default_rng(seed), CONTEXT), 16, 20, 4)
        outs.append(np.asarray(ex.run("draft", {**x, "position": np.array([p], np.int32)}, state)["logits"]).reshape(-1))
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[0], outs[2])
    fill = outs[0].min()
    per_cluster = V // assistant.args.num_centroids
    assert (outs[0] == fill).sum() == V - assistant.args.centroid_intermediate_top_k * per_cluster


def _advance(engine, cache, committed: list[int]) -> None:
    """Bring the verifier cache to hold positions 0..len(committed)-2 (trimming or running)."""
    have, want = cache[0].offset, len(committed) - 1
    if have > want:
        for c in cache:
            c.trim(have - want)
    elif want > have:
        mx.eval(engine.model(mx.array([committed[have:want]]), cache))


def _script(engine, drafter, prompt, rounds):
    """Greedy drafting rounds as the speculative mode runs them, with scripted acceptance:
    (k, accepted or None for all, or ('sync', n) to roll the committed sequence back to n tokens).
    Returns each round's draft tokens."""
    from edgespec.logits.sampling import Sampler, SamplingParams

    sampler = Sampler(SamplingParams())
    cache = engine.model.make_cache()
    drafter.bind_verifier_cache(cache)
    drafter.begin(prompt)
    _advance(engine, cache, prompt)
    out = []
    for k, n in rounds:
        if isinstance(n, tuple):
            drafter.sync(drafter.seq[: n[1]])
            _advance(engine, cache, drafter.seq)
            continue
        d = drafter.draft(k, sampler)
        out.append(d.tokens)
        n = len(d.tokens) if n is None else n
        nxt = (d.tokens[n] + 1) % V if n < len(d.tokens) else 7
        drafter.accept(n, nxt)
        _advance(engine, cache, drafter.seq)
    return out


def test_drafting_rounds_through_the_executor_equal_the_mlx_assistant(ordered):
    """Rounds with partial acceptance (deltas of 1..k+1 positions), full acceptance and a
    rollback: the executor-driven Core ML drafter drafts the MLX assistant's tokens, and only
    the new positions' keys and values cross per round."""
    from edgespec.converters.coreml_assistant import AssistantExecutorBackend
    from edgespec.converters.mil_executor import MILExecutor

    from edgespec.drafters.assistant import AssistantDrafter, load_assistant_model
    from edgespec.drafters.coreml_assistant import CoreMLAssistantDrafter

    engine, _, path, info, tmp = ordered
    rounds = [(4, 1), (3, None), (4, 0), (2, ("sync", 25)), (4, 2), (3, None), (4, 1)]
    mlx = AssistantDrafter(rounded(load_assistant_model(tmp / "assistant")), engine.model)
    want = _script(engine, mlx, SHORT[:22], rounds)
    backend = AssistantExecutorBackend(MILExecutor(path))
    got = _script(engine, CoreMLAssistantDrafter(backend, info, engine.model, device="cpu"), SHORT[:22], rounds)
    assert got == want and all(got)
    appends = [(f, pos) for f, pos in backend.calls if f.startswith("append")]
    # The prompt's 21 positions in two windows of 16; then per round only the positions it committed
    # (2, 4, 1 + ...). The rollback to 25 tokens (p = 24) resends nothing before 25; slots 25 and 26,
    # written for the abandoned sequence, are rewritten with the new one's.
    assert appends == [("append_16", 0), ("append_16", 16), ("append_4", 21), ("append_4", 23),
                       ("append_4", 25), ("append_4", 27)]


def test_convert_writes_the_package_and_speculative_with_it_equals_plain(bundle):
    """`convert --drafter ASSISTANT`: the manifest lists the package (kind, states, functions) and
    its files; here the bundle loads the MLX assistant (no Core ML), and a Core ML drafter over
    the bundle's package, run by the executor, gives plain decoding's tokens with drafts
    rejected mid-chain."""
    from edgespec.converters.coreml_assistant import AssistantExecutorBackend
    from edgespec.converters.mil_executor import MILExecutor

    from edgespec.drafters.assistant import AssistantDrafter
    from edgespec.drafters.coreml_assistant import CoreMLAssistantDrafter

    path, manifest, plain = bundle
    entry = manifest["drafter"]
    assert entry["kind"] == "gemma4_assistant" and entry["coreml"]["package"] == "drafter.mlpackage"
    assert entry["coreml"]["kind"] == "gemma4_assistant" and entry["coreml"]["append_tokens"] == [1, 2, 4, 8, 16]
    assert any(f.startswith("drafter.mlpackage/") for f in manifest["files"])
    assert json.loads((path / "manifest.json").read_text())["drafter"]["coreml"] == entry["coreml"]
    engine = edgespec.load(path, progress=False, history="off")
    assert isinstance(engine.drafter, AssistantDrafter)  # Core ML cannot run here: the MLX copy
    assert any("Core ML drafter unavailable" in n for n in getattr(engine, "drafter_notes", []))
    backend = AssistantExecutorBackend(MILExecutor(path / "drafter.mlpackage"))
    engine.drafter = CoreMLAssistantDrafter(backend, entry["coreml"], engine.model, device="cpu")
    spec = engine.generate(SHORT, max_tokens=24, mode="speculative", draft_tokens=3)
    assert spec.tokens == plain
    assert spec.stats.drafted > spec.stats.accepted > 0
    assert spec.stats.accepted_by_position[0] > spec.stats.accepted_by_position[-1]  # a rejection mid-chain
    assert sum(f == "draft" for f, _ in backend.calls) == spec.stats.drafted
    backend.calls.clear()
    assert engine.generate(SHORT, max_tokens=24).tokens == plain  # auto, no options: drafts with it too
    assert any(f == "draft" for f, _ in backend.calls)


def _assistant(folder, backbone: int = 64, **text):
    config = transformers.Gemma4AssistantConfig(
        text_config=transformers.Gemma4TextConfig(**{**ASSISTANT_TEXT, **text}), backbone_hidden_size=backbone)
    transformers.Gemma4AssistantForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("bad,match", [
    (dict(vocab_size=V - 64), "assistant's vocabulary has 256 tokens, the verifier's 320"),
    (dict(backbone=48), "verifier of width \\(hidden size\\) 48, this one is 64"),
    (dict(global_head_dim=16), "assistant layer 1 \\(full_attention\\) does not fit the verifier's layer 3"),
])
def test_convert_refuses_an_assistant_that_does_not_fit(ordered, bad, match):
    from edgespec.converters.convert import add_drafter

    from edgespec.errors import ModelLoadError

    *_, tmp = ordered
    if not (tmp / "bundle").exists():
        from edgespec.converters.convert import convert

        convert(tmp / "hf", tmp / "bundle", quantize="none", dtype="float32", progress=False)
    name = "bad_" + "_".join(bad)
    backbone = bad.pop("backbone", 64)
    src = _assistant(tmp / name, backbone=backbone, **bad)
    with pytest.raises(ModelLoadError, match=match):
        add_drafter(tmp / "bundle", src, progress=False)
    assert "drafter" not in json.loads((tmp / "bundle" / "manifest.json").read_text())


def test_convert_takes_the_folders_own_assistant(ordered):
    """A Gemma 4 folder with its assistant in drafter/ (which loading it drafts with) converts to a
    bundle carrying that assistant, no --drafter given."""
    import shutil

    from edgespec.converters.convert import convert

    *_, tmp = ordered
    shutil.copytree(tmp / "hf", tmp / "hf_own")
    shutil.copytree(tmp / "assistant", tmp / "hf_own" / "drafter")
    manifest = convert(tmp / "hf_own", tmp / "own", quantize="none", dtype="float32", progress=False,
                       drafter_options={"coreml": False})
    assert manifest["drafter"]["kind"] == "gemma4_assistant" and manifest["drafter"]["coreml"] is None
    assert (tmp / "own" / "drafter" / "config.json").is_file()


@pytest.mark.parametrize("change,match", [
    ({"backbone_hidden_size": 48}, "reads hidden states of width 48, the verifier's are 64"),
    ({"states": {"full_keys": [2, 32, CONTEXT]}}, "full_attention key buffer \\[2, 32, 48\\] does not fit"),
    ({"vocab_size": 256}, "vocabulary has 256 tokens, the verifier's 320"),
    ({"kind": None}, "not a gemma4_assistant package"),
])
def test_runtime_refuses_a_package_that_does_not_fit(ordered, change, match):
    from edgespec.drafters.coreml_assistant import CoreMLAssistantDrafter
    from edgespec.errors import ModelLoadError

    engine, _, _, info, _ = ordered
    with pytest.raises(ModelLoadError, match=match):
        CoreMLAssistantDrafter(None, {**info, **change}, engine.model, device="cpu")


def test_compressed_package_computes_the_assistant_with_its_decoded_weights(ordered):
    """--drafter-compress int4: the linear layers are packed (plain rounding) and the package computes
    the MLX assistant whose linear weights are those packs decoded; the head stays fp16."""
    from edgespec.converters.coreml_assistant import (
        assistant_shape,
        export_assistant,
        linear_weights,
    )
    from edgespec.converters.coreml_compress import compress_linear, decode_packed
    from edgespec.converters.mil_executor import MILExecutor
    from mlx.utils import tree_flatten

    from edgespec.drafters.assistant import load_assistant_model

    engine, assistant, _, _, tmp = ordered
    path = tmp / "int4.mlpackage"
    info = export_assistant(assistant, path, engine.model.args, context_length=CONTEXT, append_tokens=(16,),
                            compress="int4")
    assert info["compression"] == "int4"
    ex = MILExecutor(path)
    names = linear_weights(assistant_shape(assistant, engine.model.args, CONTEXT))
    packed = [op for op in ex.functions["draft"].operations if op.op_type == "constexpr_blockwise_shift_scale"]
    assert len(packed) == len(names) == 2 + 5 * 2
    params = dict(tree_flatten(assistant.parameters()))  # fp32, as the export packed them
    ref = rounded(load_assistant_model(tmp / "assistant"))
    decoded = {n: mx.array(decode_packed(compress_linear(np.array(params[n]), "int4"))) for n in names}
    ref.load_weights(list(decoded.items()), strict=False)
    rng = np.random.default_rng(5)
    kv = _kv(rng, CONTEXT)
    state = ex.make_state("draft")
    _append(ex, state, kv, 0, 16, 16)
    x = rng.standard_normal((1, 1, 128)).astype(np.float32)
    want, _ = ref(mx.array(x), {f"{t}_attention": (mx.array(a[:, :, :16]), mx.array(b[:, :, :16]))
                                for t, (a, b) in kv.items()}, 16)
    got = ex.run("draft", {"embedding": x[..., :64].reshape(1, 64, 1, 1), "hidden": x[..., 64:].reshape(1, 64, 1, 1),
                           "position": np.array([16], np.int32)}, state)["logits"]
    assert rel_err(np.asarray(got, np.float32).reshape(-1), np.array(want).reshape(-1)) < 1e-5
    dense, _ = rounded(load_assistant_model(tmp / "assistant"))(mx.array(x), {
        f"{t}_attention": (mx.array(a[:, :, :16]), mx.array(b[:, :, :16])) for t, (a, b) in kv.items()}, 16)
    assert rel_err(np.array(dense).reshape(-1), np.array(want).reshape(-1)) > 1e-4  # really rounded


def test_convert_refuses_calibrating_the_assistant_package(ordered):
    from edgespec.converters.convert import add_drafter, convert

    *_, tmp = ordered
    if not (tmp / "bundle").exists():
        convert(tmp / "hf", tmp / "bundle", quantize="none", dtype="float32", progress=False)
    with pytest.raises(ValueError, match="--drafter-calibrate is not implemented for Gemma 4's assistant"):
        add_drafter(tmp / "bundle", tmp / "assistant", progress=False,
                    drafter_options={"compress": "int4", "calibrate": 200})
