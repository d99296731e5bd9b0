"""Retention is measured on the right prompts: the student and its teacher are scored on exactly the same held-out
prompts with the same verifier, those prompts are disjoint from everything any stage trained on (base pre-training,
specialist fine-tuning, the merge's rollouts), and a student that memorised the training split gets no credit.

One short pipeline through the real flows, watched at the calls that pick prompts: every fine-tune's rows, the
merge's prompt pools and batches, every evaluation and every verifier call (each route's verifier, as the prompt set
builds it, wrapped to record its route and the reference it was given). The held-out prompts and answers the checks
compare against are read from the built-in world's own data, not from the prompt set the pipeline reads."""

import pytest

import tasks.evaluation.evaluate
import tasks.merging.merge
import tasks.training.pretrain
import tasks.specs.prompt_set
import tasks.training.specialist
import tasks.training.sft
from tasks.world.data import build_world, load_prompts

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def watched(prefect_server):
    """A short quick-profile pipeline (its own step counts, so no cached stage is reused) and what it looked at."""
    from flows.pipeline import pipeline
    from tasks.config import pipeline_config

    cfg = pipeline_config("quick", base_train={"steps": 50}, specialist_train={"steps": 15}, min_accuracy=0.0,
                          opd={"steps": 4, "eval_every": 2, "gate_threshold": 0.0, "batch_size": 16})
    seen = {"fine_tunes": [], "pools": [], "drawn": [], "evals": [], "verify": []}
    context = {"who": None}
    real_sft, real_eval_route = tasks.training.sft.train_sft, tasks.evaluation.evaluate.evaluate_route
    real_merge_eval_teacher, real_merge_eval_routes = tasks.merging.merge.evaluate_teacher, tasks.merging.merge.evaluate_routes
    real_sampler = tasks.merging.merge.PromptSampler
    real_verifiers = tasks.specs.prompt_set.PromptSet.__dict__["verifiers"].func  # the cached property's own builder

    def sft_spy(model, tok, prompts, completions, train_cfg, desc="sft", *a, **k):
        seen["fine_tunes"].append((desc, list(prompts)))
        return real_sft(model, tok, prompts, completions, train_cfg, desc, *a, **k)

    def verifier_spy(route, verify):
        """``route``'s verifier, recording (who is being scored, its route, the reference) on every call."""
        def spy(completion, reference, row):
            if context["who"] is not None:
                seen["verify"].append((context["who"][0], route, reference))
            return verify(completion, reference, row)
        spy.route = route
        return spy

    def verifiers_spy(self):
        return {r: verifier_spy(r, v) for r, v in real_verifiers(self).items()}

    def specialist_eval_spy(model, tok, verify, prompts, answers, *a, **k):
        seen["evals"].append(("specialist", verify.route, list(prompts), list(answers)))
        return real_eval_route(model, tok, verify, prompts, answers, *a, **k)

    def teacher_eval_spy(teacher, tok, verify, rows, answers, *a, **k):  # the merge scores only teachers this way
        seen["evals"].append(("teacher", verify.route, [r.prompt for r in rows], list(answers)))
        context["who"] = ("teacher", verify.route)
        try:
            return real_merge_eval_teacher(teacher, tok, verify, rows, answers, *a, **k)
        finally:
            context["who"] = None

    def student_eval_spy(model, tok, sets, *a, **k):
        for route, (prompts, answers) in sets.items():
            seen["evals"].append(("student", route, list(prompts), list(answers)))
        context["who"] = ("student", None)
        try:
            return real_merge_eval_routes(model, tok, sets, *a, **k)
        finally:
            context["who"] = None

    class SamplerSpy(real_sampler):
        def __init__(self, train, seed):
            seen["pools"].append({r: list(p) for r, (p, _) in train.items()})
            super().__init__(train, seed)

        def draw(self, n):
            prompts, routes, answers = super().draw(n)
            seen["drawn"].extend(prompts)
            return prompts, routes, answers

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tasks.training.sft, "train_sft", sft_spy)
        mp.setattr(tasks.training.pretrain, "train_sft", sft_spy)
        mp.setattr(tasks.training.specialist, "evaluate_route", specialist_eval_spy)
        mp.setattr(tasks.merging.merge, "evaluate_teacher", teacher_eval_spy)
        mp.setattr(tasks.merging.merge, "evaluate_routes", student_eval_spy)
        mp.setattr(tasks.specs.prompt_set.PromptSet, "verifiers", property(verifiers_spy))
        mp.setattr(tasks.merging.merge, "PromptSampler", SamplerSpy)
        result = pipeline(cfg)
    return cfg, result, seen


def _held_out(cfg) -> dict[str, tuple[list[str], list[str]]]:
    """Route -> (prompts, reference answers) of the world's ``eval`` split, read from the world's dataset itself (not
    through the prompt set the pipeline reads, which is under test)."""
    ev = load_prompts(build_world(cfg.world))["eval"]
    return {r: (list(ev.filter(lambda x, r=r: x["route"] == r)["prompt"]),
                list(ev.filter(lambda x, r=r: x["route"] == r)["answer"])) for r in dict.fromkeys(ev["route"])}


def test_student_and_teacher_are_scored_on_the_same_held_out_prompts_with_the_same_verifier(watched):
    cfg, result, seen = watched
    held_out = _held_out(cfg)
    assert sorted(held_out) == sorted(cfg.world.routes)
    by_who: dict[tuple[str, str], list[tuple[list[str], list[str]]]] = {}
    for who, route, prompts, answers in seen["evals"]:
        by_who.setdefault((who, route), []).append((prompts, answers))
    evals_per_student = 1 + cfg.opd.steps // cfg.opd.eval_every  # step 0, then every eval_every (the last included)
    for route, (prompts, answers) in held_out.items():
        assert by_who[("teacher", route)] == [(prompts, answers)], route
        assert by_who[("specialist", route)] == [(prompts, answers)], route  # the registry's eval_score
        assert by_who[("student", route)] == [(prompts, answers)] * evals_per_student, route
        for who in ("teacher", "student"):
            checked = [a for w, r, a in seen["verify"] if w == who and r == route]
            assert checked == answers * (1 if who == "teacher" else evals_per_student), (who, route)
    # Nothing else was verified under those two roles: no route judged by another route's verifier.
    assert {(w, r) for w, r, _ in seen["verify"]} == {(w, r) for w in ("teacher", "student") for r in held_out}
    rows = {r["route"]: r for r in result["rows"]}
    assert all(rows[r]["retention"] == pytest.approx(tasks.evaluation.evaluate.retention(rows[r]["student_accuracy"],
                                                                             rows[r]["teacher_accuracy"]))
               for r in held_out)


def test_held_out_prompts_are_disjoint_from_every_training_split(watched):
    cfg, _, seen = watched
    held_out = {p for prompts, _ in _held_out(cfg).values() for p in prompts}
    descs = [desc for desc, _ in seen["fine_tunes"]]
    assert "base pre-training" in descs and sorted(d for d in descs if d.startswith("specialist ")) == sorted(
        f"specialist {r}" for r in cfg.world.routes), descs
    for desc, prompts in seen["fine_tunes"]:
        assert prompts and not held_out & set(prompts), (desc, sorted(held_out & set(prompts))[:5])
    assert len(seen["pools"]) == 1
    (pools,) = seen["pools"]
    assert sorted(pools) == sorted(cfg.world.routes)
    for route, prompts in pools.items():
        assert prompts and not held_out & set(prompts), route
    assert len(seen["drawn"]) == cfg.opd.steps * cfg.opd.batch_size and not held_out & set(seen["drawn"])
    # The world itself: train and eval share no problem within a route either (the same problem under another
    # route's tag is another prompt, with another answer).
    ds = load_prompts(build_world(cfg.world))
    for route in cfg.world.routes:
        train = set(ds["train"].filter(lambda x: x["route"] == route)["problem"])
        ev = set(ds["eval"].filter(lambda x: x["route"] == route)["problem"])
        assert train and ev and not train & ev, route


def test_a_student_that_memorised_the_training_split_gets_no_credit(watched):
    """A model fine-tuned hard on a small world's whole training split (24 rev-low problems) answers those and little
    else; scored the way the merge scores (the held-out sets tasks.merging.merge evaluates on) it gets its held-out accuracy,
    not its training accuracy."""
    from tasks.config import TrainConfig
    from tasks.evaluation.evaluate import evaluate_routes
    from tasks.modeling.models import create_model
    from tasks.specs.prompt_set import build_prompt_set, load_prompt_set
    from tasks.specs.tokenizer import load_tokenizer
    from tasks.world.spec import write_world_spec

    cfg, _, _ = watched
    small = cfg.world.model_copy(update={"routes": ["rev-low"], "train_size": 24, "eval_size": 100})
    world = build_world(small)
    ps = load_prompt_set(build_prompt_set(write_world_spec(small, world)))  # what the merge reads for this world
    tok = load_tokenizer(world / "tokenizer")
    train = load_prompts(world)["train"]
    assert len(train) == 24
    m = cfg.model
    model = create_model(tok, arch=m.arch, hidden_size=m.hidden_size, num_layers=m.num_layers, num_heads=m.num_heads,
                         intermediate_size=m.intermediate_size, seed=5)
    tasks.training.sft.train_sft(model, tok, train["prompt"], train["completion"],
                          TrainConfig(steps=400, lr=3e-3, warmup_steps=20, batch_size=24), desc="memorise")
    caps = ps.caps()
    on_train = evaluate_routes(model, tok, {"rev-low": (list(train["prompt"]), list(train["answer"]))}, caps,
                               ps.verifiers)["rev-low"].accuracy
    reported = evaluate_routes(model, tok, ps.eval_sets(), caps, ps.verifiers)["rev-low"].accuracy
    assert len(ps.eval_sets()["rev-low"][0]) == 100
    print(f"\nmemoriser: {on_train:.2f} on its 24 training rows, {reported:.2f} on the held-out prompts")
    assert on_train >= 0.9, on_train  # it did memorise
    assert reported <= 0.3, reported  # and the score the merge would report does not reward it
