"""`edgespec distill` on tiny models: data, loss falls, exact resume, saved drafter drafts."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import make_tiny_model, make_tiny_tokenizer
from edgespec.converters.distill.data import build_dataset, generate_batch, load_dataset
from edgespec.converters.distill.prompts import PromptItem, read_prompts
from edgespec.converters.distill.student import init_student, student_config
from edgespec.converters.distill.train import TrainConfig, prepare, train
from edgespec.converters.distill.vocab import choose_vocab, token_counts

from edgespec.drafters.distilled import DistilledDrafter, VocabMap
from edgespec.logits.sampling import Sampler, SamplingParams
from edgespec.weights.loader import LoadedModel


def _verifier(seed=3):
    model = make_tiny_model(seed, scale=3.0, num_hidden_layers=3)
    return LoadedModel(model, make_tiny_tokenizer(model.args.vocab_size), None)


def _items(n=12):
    words = ["abc", "hello", "xyz", "data", "Mix", "zz top", "QRS", "lmno"]
    return [PromptItem(" ".join(words[i % 8 : i % 8 + 2]) + str(i), "toy", "text" if i % 4 == 3 else "prompt") for i in range(n)]


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A finished tiny dataset, its vocab map and the verifier."""
    loaded = _verifier()
    folder = tmp_path_factory.mktemp("data")
    build_dataset(loaded, _items(), folder, max_new=12, topk=4, batch_size=4)
    meta, exs = load_dataset(folder)
    vmap = VocabMap(choose_vocab(token_counts(exs, 64), 40, always=[0]), 64)
    return loaded, exs, vmap


def test_batched_generation_matches_one_by_one():
    loaded = _verifier()
    prompts = [[5, 6, 7], [9, 3, 4, 5, 6, 1], [2]]
    together = generate_batch(loaded.model, prompts, 8, 3, set())
    for p, (g, ids, lp) in zip(prompts, together, strict=True):
        alone = generate_batch(loaded.model, [p], 8, 3, set())[0]
        assert g == alone[0]
        assert ids[:, 0].tolist() == g  # the greedy token leads the top-k
        assert np.all(np.diff(lp.astype(np.float32), axis=1) <= 0)


def test_sampled_answers_share_the_prefill_and_record_their_own_targets():
    """samples=3: row 0 of a prompt is its greedy answer; rows 1-2 are sampled, and every
    row's recorded top-k equals a teacher-forced pass over that row's own text."""
    from edgespec.converters.distill.data import score_text

    loaded = _verifier()
    prompts = [[5, 6, 7], [9, 3, 4, 5, 6, 1]]
    rows = generate_batch(loaded.model, prompts, 10, 3, set(), samples=3, temperature=1.5, seed=4)
    assert len(rows) == 6
    for b, p in enumerate(prompts):
        greedy = generate_batch(loaded.model, [p], 10, 3, set())[0]
        assert rows[3 * b][0] == greedy[0]
        assert any(rows[3 * b + s][0] != greedy[0] for s in (1, 2))  # temperature 1.5 on a random model
        for s in range(3):
            g, ids, lp = rows[3 * b + s]
            tf_ids, tf_lp = score_text(loaded.model, p + g, 3)
            np.testing.assert_array_equal(ids, tf_ids[len(p) - 1 :])
            np.testing.assert_allclose(lp.astype(np.float32), tf_lp[len(p) - 1 :].astype(np.float32), atol=2e-2)
    again = generate_batch(loaded.model, prompts, 10, 3, set(), samples=3, temperature=1.5, seed=4)
    assert [r[0] for r in again] == [r[0] for r in rows]  # seeded: a resumed build makes the same data


def test_data_resume_and_settings_check(tmp_path):
    loaded = _verifier()
    build_dataset(loaded, _items(8), tmp_path, max_new=6, topk=3, batch_size=4)
    first = load_dataset(tmp_path)[1]
    (tmp_path / "shard-00001.npz").unlink()  # simulate an interrupted build
    (tmp_path / "complete").unlink()
    build_dataset(loaded, _items(8), tmp_path, max_new=6, topk=3, batch_size=4)
    again = load_dataset(tmp_path)[1]
    assert [e.tokens.tolist() for e in first] == [e.tokens.tolist() for e in again]
    with pytest.raises(ValueError, match="other settings"):
        build_dataset(loaded, _items(8), tmp_path, max_new=7, topk=3, batch_size=4)


def test_shard_plan_prefix_is_balanced_and_max_shards(tmp_path):
    from edgespec.converters.distill.data import shard_plan

    loaded = _verifier()
    items = [PromptItem(f"ab{i}", dom) for i in range(6) for dom in ("x", "y", "z")]
    plan = shard_plan(loaded.tokenizer, items, 2, 64)
    assert [{items[i].domain for i, _ in g} for g in plan[:3]] == [{"x"}, {"y"}, {"z"}]
    build_dataset(loaded, items, tmp_path, max_new=3, topk=2, batch_size=2, max_shards=3)
    exs = load_dataset(tmp_path)[1]
    assert sorted(e.domain for e in exs) == ["x", "x", "y", "y", "z", "z"]


def test_builtin_prompts_cover_domains_and_heldout_is_disjoint():
    train_items = read_prompts()
    held = read_prompts(__import__("edgespec.converters.distill.prompts", fromlist=["x"]).builtin_path("distill_prompts_heldout.jsonl"))
    assert {"code", "chat", "summarization", "translation"} <= {i.domain for i in train_items}
    assert not {i.text for i in train_items} & {i.text for i in held}


def test_vocab_map_roundtrip_and_coverage(toy, tmp_path):
    _, exs, vmap = toy
    assert vmap.ids[0] == -1 and 0 in vmap.ids.tolist()
    vmap.save(tmp_path, vocab_hash="abc")
    back = VocabMap.load(tmp_path)
    assert back.ids.tolist() == vmap.ids.tolist()
    greedy = np.concatenate([e.topk_ids[:, 0] for e in exs])
    assert vmap.coverage(greedy) > 0.9
    with pytest.raises(ValueError):
        VocabMap([3, 4], 64)


def _student(toy, seed=0):
    loaded, _, vmap = toy
    cfg = student_config(loaded.model.args, 1, vmap.size)
    return init_student(cfg, loaded.model, vmap.ids, [2], seed=seed), cfg


def test_loss_falls(toy):
    loaded, exs, vmap = toy
    student, _ = _student(toy)
    data = prepare(exs, vmap, 128)
    losses = train(student, data, TrainConfig(steps=40, batch_size=4, lr=3e-3, warmup=2))
    assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])


def test_resume_reproduces_uninterrupted_weights(toy, tmp_path):
    _, exs, vmap = toy
    data = prepare(exs, vmap, 128)
    cfg = TrainConfig(steps=9, batch_size=3, lr=1e-3, warmup=2, checkpoint_every=2)
    straight, _ = _student(toy)
    train(straight, data, cfg)
    resumed, _ = _student(toy)
    ckpt = tmp_path / "ckpt.safetensors"
    train(resumed, data, cfg, checkpoint=ckpt, stop_after=5)  # "interrupted" after step 5 (ckpt at 4)
    resumed2, _ = _student(toy)  # a fresh process: new model, state from the checkpoint
    train(resumed2, data, cfg, checkpoint=ckpt)
    a = dict(__import__("mlx.utils", fromlist=["x"]).tree_flatten(straight.parameters()))
    b = dict(__import__("mlx.utils", fromlist=["x"]).tree_flatten(resumed2.parameters()))
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k], b[k]), k
    with pytest.raises(ValueError, match="other training settings"):
        train(_student(toy)[0], data, TrainConfig(steps=10, batch_size=3), checkpoint=ckpt)


def test_distilled_drafter_expands_to_full_vocab(toy):
    loaded, _, vmap = toy
    student, _ = _student(toy)
    d = DistilledDrafter(student, vmap)
    assert d.vocab_size == 64
    d.begin([5, 6, 7])
    draft = d.draft(3, Sampler(SamplingParams(temperature=0.0)))
    assert len(draft.tokens) == 3 and draft.logprobs.shape == (3, 64)
    outside = [i for i in range(64) if i not in set(vmap.ids[1:].tolist())]
    assert all(t in set(vmap.ids[1:].tolist()) for t in draft.tokens)
    if outside:
        assert bool(mx.all(draft.logprobs[:, outside] == -mx.inf))
    d.accept(1, draft.tokens[1])
    assert d.seq == [5, 6, 7, draft.tokens[0], draft.tokens[1]]
    json.dumps(vmap.ids.tolist())


def test_distilled_drafter_ranks_its_slots_as_the_full_vocabulary_would(toy):
    """DistilledDrafter ranks over its kept slots (cheaper): the same tokens and probabilities
    as ranking the full-vocabulary logits (q = 0 outside the kept set)."""
    from edgespec.drafters.base import ranked_tokens

    student, _ = _student(toy)
    _, _, vmap = toy
    d = DistilledDrafter(student, vmap)
    d.begin([5, 6, 7, 9])
    got = d.draft(4, Sampler(SamplingParams(temperature=0.0)), ranks=3)
    fresh = DistilledDrafter(student, vmap)
    fresh.begin([5, 6, 7, 9])
    feed = [9]
    for j, tok in enumerate(got.tokens):
        logits = fresh._forward(mx.array(feed, dtype=mx.int32)[None])[-1]
        ids, probs = ranked_tokens(logits, mx.array(tok), 3)
        assert got.ranked[0][j].tolist() == np.array(ids).tolist()
        np.testing.assert_allclose(got.ranked[1][j], np.array(probs), rtol=1e-5, atol=1e-7)
        feed = [tok]


def test_fast_acceptance_equals_drafting_loop(toy):
    from edgespec.converters.distill.evaluate import acceptance, acceptance_fast

    _, exs, vmap = toy
    student, _ = _student(toy)
    data = prepare(exs, vmap, 128)
    train(student, data, TrainConfig(steps=15, batch_size=4, lr=3e-3, warmup=2))
    slow = acceptance(DistilledDrafter(student, vmap), exs, k=3)
    fast = acceptance_fast(student, vmap, exs, k=3)
    assert slow == fast
    assert 0 < slow["all"]["accepted"] < slow["all"]["drafted"]


def test_freeze_embedding_keeps_rows(toy):
    _, exs, vmap = toy
    student, _ = _student(toy)
    before = mx.array(student.model.embed_tokens.weight)
    losses = train(student, prepare(exs, vmap, 128), TrainConfig(steps=8, batch_size=4, lr=3e-3, warmup=2, freeze_embedding=True))
    assert mx.array_equal(before, student.model.embed_tokens.weight)
    assert losses[-1] < losses[0]


def test_local_prompt_builder_harvests_code_prose_and_chat(tmp_path):
    from edgespec.converters.distill.local_prompts import build

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    prose = ("The scheduler keeps a queue of pending jobs and starts the oldest one first. "
             "Each job records when it was submitted and how long it ran. When the queue is empty "
             "the scheduler sleeps until a new job arrives, which keeps the machine quiet at night.")
    (pkg / "mod.py").write_text(
        f'"""{prose}"""\n\n'
        "def count_words(text):\n"
        '    """Return the number of words in a piece of text."""\n'
        "    words = text.split()\n"
        "    n = 0\n"
        "    for w in words:\n"
        "        n += 1\n"
        "    return n\n"
    )
    rows = build(per_domain=6, seed=1, roots=[pkg], exclude={"What is gravity?"})
    by = {d: [r["prompt"] for r in rows if r["domain"] == d] for d in ("code", "chat", "summarization", "translation")}
    assert all(by.values())
    assert any("def count_words" in p for p in by["code"])
    assert "Write a Python function that returns the number of words in a piece of text." in by["code"]
    assert all(prose in p for p in by["summarization"])
    assert any("The scheduler keeps a queue of pending jobs and starts the oldest one first." in p
               for p in by["translation"])
    assert len(set(map(str, rows))) == len(rows) and "What is gravity?" not in by["chat"]
    assert build(per_domain=6, seed=1, roots=[pkg]) == build(per_domain=6, seed=1, roots=[pkg])  # deterministic


def test_calibration_answers_take_each_prompts_greedy_answer(tmp_path):
    """The built-in calibration text is made from distillation data: the first (greedy) answer of
    each distinct chat prompt, decoded; a prompt without an answer is an error naming it."""
    from edgespec.converters.distill.calibration_text import answers_from_data

    loaded = _verifier()
    items = _items(5)
    items = items + [items[0]]  # a repeated prompt yields one row
    build_dataset(loaded, items, tmp_path / "greedy", max_new=6, topk=2, batch_size=4)
    build_dataset(loaded, items, tmp_path / "sampled", max_new=6, topk=2, batch_size=4, samples=3)
    rows = answers_from_data(tmp_path / "greedy", loaded.tokenizer, items)
    assert [r["prompt"] for r in rows] == [it.text for it in items[:5] if it.kind == "prompt"]  # not text
    assert rows == answers_from_data(tmp_path / "sampled", loaded.tokenizer, items)
    first = load_dataset(tmp_path / "greedy")[1]
    by_prompt = {tuple(e.tokens[: e.start].tolist()): e for e in first}
    from edgespec.converters.distill.prompts import encode_item

    ex = by_prompt[tuple(encode_item(loaded.tokenizer, items[2], 384))]
    assert rows[2]["answer"] == loaded.tokenizer.decode(ex.tokens[ex.start :].tolist(), skip_special_tokens=True).strip()
    with pytest.raises(ValueError, match="no answer for 1 prompts"):
        answers_from_data(tmp_path / "greedy", loaded.tokenizer, items + [PromptItem("never asked")])


def test_builtin_calibration_answers_are_the_training_prompts_only():
    """One answer per distinct training prompt, none for a held-out prompt (those stay unseen)."""
    from edgespec.converters.distill.calibration_text import HELDOUT_ANSWERS, read_answers
    from edgespec.converters.distill.prompts import BUILTIN_HELDOUT, builtin_path

    heldout = {it.text for it in read_prompts(builtin_path(BUILTIN_HELDOUT))}
    rows = read_answers()
    prompts = [r["prompt"] for r in rows]
    assert len(prompts) == len(set(prompts)) and set(prompts) == {it.text for it in read_prompts()}
    assert not set(prompts) & heldout
    assert all(r["answer"].strip() for r in rows)
    measuring = read_answers(builtin_path(HELDOUT_ANSWERS))  # the held-out file: measuring only
    assert {r["prompt"] for r in measuring} == heldout and all(r["answer"].strip() for r in measuring)
    with pytest.raises(ValueError, match="no such calibration answers file"):
        read_answers(builtin_path("missing.jsonl"))


@pytest.mark.parametrize("text, message", [
    ('{"prompt": "a", "answer": "b"}\n{"prompt": "c"', ":2: invalid JSON"),
    ('{"prompt": "a"}\n', ":1: each line needs"),
    ('["a", "b"]\n', ":1: each line needs"),
    ("\n\n", "holds no answers"),
])  # fmt: skip
def test_calibration_answers_file_errors_name_the_line(tmp_path, text, message):
    from edgespec.converters.distill.calibration_text import read_answers

    path = tmp_path / "answers.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_answers(path)
