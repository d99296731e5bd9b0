"""Guided OPD (registry ``wrapper: guided``, tasks/training/guided.py): the student continues from a prefix of its
teacher's own solution, withdrawn over a schedule; the prefix tokens stay out of the loss. Unit tests of the
schedule, the prefix, the rollout laid out around it (against transformers' own generation from prompt + prefix),
the batch source in the producer, and the record rules; the end-to-end merge is test_guided_merge_e2e.py."""

from pathlib import Path

import pytest
import torch

from tests.tiny import tiny_llama

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DATA / "smollm2-tokenizer")


def test_the_prefix_is_withdrawn_linearly_and_never_covers_the_end_token():
    from tasks.training.guided import GuideSchedule, prefix_length

    s = GuideSchedule(0.5, 4)
    assert [s.at(i) for i in (0, 1, 2, 4, 9)] == [0.5, 0.375, 0.25, 0.0, 0.0]
    eos = (2,)
    assert prefix_length([5, 6, 7, 8, 2], 0.5, eos) == 2  # half of the 4 tokens before the end
    assert prefix_length([5, 6, 7, 8, 2], 1.0, eos) == 4  # all of them, never the end token itself
    assert prefix_length([5, 6, 7], 1.0, eos) == 3  # a sample cut at its cap has no end token
    assert prefix_length([5, 6, 7, 8, 2], 0.3, eos) == 1  # floor(1.2)
    assert prefix_length([2], 1.0, eos) == 0
    for bad in ((0.0, 4), (1.5, 4), (0.5, 0)):
        with pytest.raises(ValueError, match="guide schedule"):
            GuideSchedule(*bad)


def test_a_guided_rollout_is_the_teachers_prefix_then_the_students_own_continuation(tok):
    from tasks.modeling.rollout import eos_ids, generate

    model = tiny_llama(tok, 3, 512).eval()
    prompts = ["<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n", "Count: one two"]
    prefixes = [tok("The colour is", add_special_tokens=False)["input_ids"], []]
    ro = generate(model, tok, prompts, 5, greedy=True, prefixes=prefixes)
    P = ro.prompt_width
    for b, (p, x) in enumerate(zip(prompts, prefixes)):
        start, end = ro.response_span(b)
        response = ro.sequences_B_T[b, start:end].tolist()
        assert response[:len(x)] == x
        # The continuation is exactly what the model generates after prompt + prefix (greedy, one row alone).
        ids = torch.tensor([tok(p, add_special_tokens=False)["input_ids"] + x])
        want = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                              pad_token_id=tok.pad_token_id, eos_token_id=list(eos_ids(tok, model)))[0, ids.shape[1]:]
        want = want.tolist()
        stops = [i for i, t in enumerate(want) if t in eos_ids(tok, model)]
        assert response[len(x):] == (want[:stops[0] + 1] if stops else want)
        # The prefix is external: no loss there; the student's own tokens are all in it.
        spans = ro.spans(b)
        assert [s.source for s in spans] == ["prompt"] + (["external"] if x else []) + ["student"]
        if x:
            assert spans[1] == (P, P + len(x), "external")
        mask_T = ro.loss_mask_B_T()[b]  # positions predicting the next token
        assert int(mask_T.sum()) == end - start - len(x)
        assert not bool(mask_T[P - 1:P - 1 + len(x)].any())  # no position predicts a prefix token


def test_the_cap_counts_the_prefix_and_the_students_tokens_alone_are_counted_as_generated(tok):
    from tasks.specs.verifiers import exact
    from tasks.training.distill import sample_batch

    model = tiny_llama(tok, 4, 512).eval()
    prompts, routes = ["Say hi.", "Say bye."], ["a", "b"]
    prefix = tok(" one two three", add_special_tokens=False)["input_ids"]
    verifiers = {r: exact() for r in routes}
    batch = sample_batch(model, tok, prompts, routes, ["x", "y"], [6, 6], 0, verifiers=verifiers,
                         prefixes=[prefix, []], generator=torch.Generator().manual_seed(0))
    lengths = batch.rollout.response_lengths_B.tolist()
    assert all(n <= 6 for n in lengths)  # the prefix inside the route's cap
    own = int(batch.rollout.loss_tokens_B_T.sum())
    assert batch.generated_tokens == own == sum(lengths) - len(prefix)
    assert batch.guided_tokens == len(prefix)
    with pytest.raises(ValueError, match="transformers rollout backend"):
        sample_batch(model, tok, prompts, routes, ["x", "y"], [6, 6], 0, verifiers=verifiers, engine=object(),
                     prefixes=[prefix, []])


class _Samples:
    """A teacher's cached samples, as OffPolicyData.teacher_samples gives them, counting the calls."""

    def __init__(self, ids):
        self.ids, self.calls = ids, 0

    def __call__(self, texts, caps, generator=None):
        self.calls += 1
        return [list(self.ids) for _ in texts], len(texts), len(texts) * len(self.ids)


def test_the_batch_source_guides_only_its_routes_and_only_while_its_schedule_lasts(tok):
    from tasks.specs.render import RowText
    from tasks.training.guided import GuidedPrefixes, GuideSchedule

    eos = tok.eos_token_id
    samples = _Samples([11, 12, 13, 14, 15, 16, 17, 18, eos])
    guide = GuidedPrefixes({"hard": GuideSchedule(1.0, 4)}, samples, (eos,), origin=10)
    texts = [RowText("hard", "p1"), RowText("easy", "p2"), RowText("hard", "p3")]
    caps = [16, 16, 4]
    prefixes, tokens = guide.prefixes(texts, caps, 10)
    assert prefixes == [[11, 12, 13, 14, 15, 16, 17, 18], [], [11, 12, 13]]  # the cap leaves the student one token
    assert tokens == 2 * 9
    assert guide.prefixes(texts, caps, 12)[0][0] == [11, 12, 13, 14]  # half withdrawn at stage step 2
    assert guide.fractions(13) == {"hard": 0.25}
    calls = samples.calls
    assert guide.prefixes(texts, caps, 14) == ([[], [], []], 0) and not guide.active(["hard"], 14)
    assert samples.calls == calls  # no teacher sample drawn once the schedule has run out
    assert not guide.active(["easy"], 10) and guide.active(["easy", "hard"], 10)


def test_the_producer_makes_guided_on_policy_batches_from_the_teachers_cached_samples(tok):
    from tasks.modeling.rollout import eos_ids
    from tasks.specs.verifiers import exact
    from tasks.training.distill import BatchProducer, OffPolicyData, PromptSampler
    from tasks.training.guided import GuidedPrefixes, GuideSchedule

    student = tiny_llama(tok, 5, 512)

    class Sampler:  # a teacher whose own sample is always the same words
        def sample(self, tok_, rows, caps, temperature, generator=None):
            from tasks.modeling.rollout import rollout_from_responses
            ids = tok_(" alpha beta gamma delta", add_special_tokens=False)["input_ids"] + [tok_.eos_token_id]
            return rollout_from_responses(tok_, [r.prompt for r in rows], [ids] * len(rows))

    routes = {"hard": (["Q1", "Q2"], ["a", "b"]), "easy": (["Q3"], ["c"])}
    verifiers = {r: exact() for r in routes}
    off = OffPolicyData("dataset", tok, {"t-hard": Sampler(), "t-easy": Sampler()},
                        {"hard": "t-hard", "easy": "t-easy"}, {}, verifiers=verifiers, eos=eos_ids(tok))
    guide = GuidedPrefixes({"hard": GuideSchedule(1.0, 2)}, off.teacher_samples, eos_ids(tok), origin=0)
    producer = BatchProducer(student, tok, PromptSampler(routes, 0), off, {"hard": 12, "easy": 12}, 6,
                             verifiers=verifiers, guide=guide)
    words = tok(" alpha beta gamma delta", add_special_tokens=False)["input_ids"]
    first = producer.next(1.0, 0)
    for b, route in enumerate(first.routes):
        start, _ = first.rollout.response_span(b)
        head = first.rollout.sequences_B_T[b, start:start + len(words)].tolist()
        spans = [s.source for s in first.rollout.spans(b)]
        assert ("external" in spans) == (route == "hard")
        if route == "hard":
            assert head == words
    assert first.guided_tokens == len(words) * first.routes.count("hard")
    assert first.teacher_tokens == (len(words) + 1) * len(set(p for p, r in zip(
        [t.prompt for t in first.texts], first.routes) if r == "hard"))
    late = producer.next(1.0, 2)  # the schedule has run out: the student's own rollouts only
    assert late.guided_tokens == 0 and late.teacher_tokens == 0
    assert all("external" not in [s.source for s in late.rollout.spans(b)] for b in range(len(late.routes)))
    producer.close()


def test_a_guided_record_needs_its_schedule_and_no_other_record_has_one():
    from teachers.registry import TeacherRecord

    common = dict(name="g", route="rev-high", model_uri="/m", tokenizer_fingerprint="sha256:x")
    rec = TeacherRecord(**common, wrapper="guided", guide_fraction=0.5, guide_steps=100)
    assert (rec.guide_fraction, rec.guide_steps) == (0.5, 100)
    with pytest.raises(ValueError, match="guided teacher needs guide_fraction > 0"):
        TeacherRecord(**common, wrapper="guided")
    with pytest.raises(ValueError, match="are for a guided teacher"):
        TeacherRecord(**common, guide_fraction=0.5, guide_steps=10)
    from tasks.modeling.routing import registry_fingerprint
    other = rec.model_copy(update={"guide_steps": 50})
    assert registry_fingerprint([rec]) != registry_fingerprint([other])  # the schedule is part of the teacher


def test_a_guided_teacher_on_the_vllm_rollout_backend_is_refused_with_the_reason():
    from tasks.modeling.routing import guided_refusal
    from teachers.registry import TeacherRecord
    from teachers.router import Router

    common = dict(route="rev-high", model_uri="/m", tokenizer_fingerprint="sha256:x")
    router = Router({"rev-high": TeacherRecord(name="g", wrapper="guided", guide_fraction=0.5, guide_steps=10,
                                               **common),
                     "rev-low": TeacherRecord(name="p", **{**common, "route": "rev-low"})})
    assert guided_refusal(router, ["rev-high", "rev-low"], "hf") == ""
    assert guided_refusal(router, ["rev-low"], "vllm") == ""
    refusal = guided_refusal(router, ["rev-high", "rev-low"], "vllm")
    assert refusal.startswith("'vllm', but route(s) ['rev-high'] have a guided teacher")
    assert refusal.endswith("expected opd.rollout_backend hf")
