"""On-policy mechanics on tiny real models: per-route caps, off-policy batches (GKD's lambda), behaviour log-probs,
the compliance gate, per-route weights and objectives, verifier advantages, and overlapped generation."""

import pytest
import torch

from tasks.training.distill import (
    BatchProducer,
    OffPolicyData,
    PromptSampler,
    sample_batch,
    score_with_teachers,
    sequence_advantages,
    update_step,
)
from tasks.evaluation.evaluate import compliance_gate
from tasks.objectives.losses import Objective, chunked_objective
from tasks.modeling.models import create_model
from tasks.modeling.rollout import (
    cap_responses,
    forward_hidden,
    generate,
    position_ids_from_mask,
    response_ids,
    rollout_from_responses,
    token_logprobs,
)
from tasks.modeling.teacher import checkpoint_teachers
from tasks.world.tokenizer import build_char_tokenizer
from tasks.world.domains import Route, domain_of, format_ok, format_prompt, gold_completion
from tasks.world.spec import world_verifiers

ROUTES = ["shift-low", "rev-high", "sort-low"]
PROBLEMS = {"shift-low": ["1:ab", "2:xyz", "3:abc"], "rev-high": ["abcd", "qwe", "zz"], "sort-low": ["5203", "91", "777"]}
VERIFIERS = world_verifiers(ROUTES)


def well_formed(route: str, text: str) -> bool:
    return format_ok(Route.parse(route), text)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def tiny(tok, seed):
    return create_model(tok, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64, seed=seed).eval()


def train_sets():
    """route -> (prompts, reference answers)."""
    return {r: ([format_prompt(Route.parse(r), p) for p in ps], [domain_of(Route.parse(r)).answer(p) for p in ps])
            for r, ps in PROBLEMS.items()}


def gold_map():
    return {format_prompt(Route.parse(r), p): gold_completion(Route.parse(r), p) for r, ps in PROBLEMS.items() for p in ps}


class CountingGenerate:
    """Wraps a model's ``generate`` to count calls (the model itself runs for real)."""

    def __init__(self, model):
        self.calls, self._inner = 0, model.generate
        model.generate = self

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._inner(*args, **kwargs)


class FixedEOS(torch.nn.Module):
    """An output head that forces the EOS logit to -1e9 (never EOS) or +1e9 (EOS at once)."""

    def __init__(self, head, eos_id, value):
        super().__init__()
        self.head, self.eos_id, self.value = head, eos_id, value

    def forward(self, h):
        z = self.head(h)
        z[..., self.eos_id] = self.value
        return z


def test_per_route_caps_cut_responses_and_mark_truncation(tok):
    torch.manual_seed(0)
    prompts = [format_prompt(Route.parse("rev-high"), "abcd")] * 4
    ro = generate(tiny(tok, 0), tok, prompts, max_new_tokens=8)
    assert ro.response_lengths_B[1] > 3 and ro.response_lengths_B[2] > 1  # the caps below have something to cut
    capped = cap_responses(ro, [8, 3, 1, 8], tok.eos_token_id)
    lengths = capped.response_lengths_B.tolist()
    assert lengths[1] <= 3 and lengths[2] <= 1
    assert lengths[0] == ro.response_lengths_B[0] and lengths[3] == ro.response_lengths_B[3]
    for row in range(4):
        ids = response_ids(capped)[row]
        assert bool(capped.truncated_B[row]) == (tok.eos_token_id not in ids)
    assert torch.equal(capped.attention_mask_B_T[:, capped.prompt_width:], capped.response_mask_B_T[:, capped.prompt_width:])


def test_rollout_from_responses_round_trips_a_generated_rollout(tok):
    torch.manual_seed(1)
    model = tiny(tok, 1)
    prompts = [format_prompt(Route.parse(r), PROBLEMS[r][0]) for r in ROUTES]
    ro = generate(model, tok, prompts, max_new_tokens=7)
    rebuilt = rollout_from_responses(tok, prompts, response_ids(ro))
    assert response_ids(rebuilt) == response_ids(ro)
    assert torch.equal(rebuilt.truncated_B, ro.truncated_B)
    mask_B_T = rebuilt.loss_mask_B_T()
    # The same states: hidden states at the positions that predict response tokens agree.
    h1 = forward_hidden(model, ro.sequences_B_T, ro.attention_mask_B_T)[:, :-1]
    h2 = forward_hidden(model, rebuilt.sequences_B_T, rebuilt.attention_mask_B_T)[:, :-1]
    for b in range(len(prompts)):
        a = h1[b][ro.loss_mask_B_T()[b].bool()]
        c = h2[b][mask_B_T[b].bool()]
        assert torch.allclose(a, c, atol=1e-5)


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_token_logprobs_match_a_full_forward_at_each_temperature(tok, temperature):
    torch.manual_seed(2)
    model = tiny(tok, 2)
    prompts = [format_prompt(Route.parse(r), PROBLEMS[r][1]) for r in ROUTES]
    ro = generate(model, tok, prompts, max_new_tokens=6, temperature=temperature)
    (lp_B_T,) = token_logprobs(model, ro, (temperature,), chunk_size=3)
    with torch.no_grad():
        logits = model(input_ids=ro.sequences_B_T, attention_mask=ro.attention_mask_B_T,
                       position_ids=position_ids_from_mask(ro.attention_mask_B_T)).logits[:, :-1]
    ref = torch.log_softmax(logits / temperature, -1).gather(-1, ro.sequences_B_T[:, 1:, None]).squeeze(-1)
    m = ro.loss_mask_B_T().bool()
    assert torch.allclose(lp_B_T[m], ref[m], atol=1e-5)


def _producer(tok, student, teacher, lmbda_source="teacher", overlap=False, seed=0):
    teachers = checkpoint_teachers({"t": teacher})
    off = OffPolicyData(lmbda_source, tok, teachers, {r: "t" for r in ROUTES}, gold_map(), verifiers=VERIFIERS)
    return BatchProducer(student, tok, PromptSampler(train_sets(), seed), off, {r: 8 for r in ROUTES}, batch_size=6,
                         overlap=overlap, verifiers=VERIFIERS), off


def test_overlap_shares_the_cores_out_between_generation_and_update(tok):
    """With overlap and n >= 2 torch threads, the background generation runs on n // 2 and the update on the rest
    (not 2n threads on n cores); close() gives the update its n back. One thread stays one for both."""
    student, teacher = tiny(tok, 3), tiny(tok, 4)
    before = torch.get_num_threads()
    try:
        for n, gen, upd in ((4, 2, 2), (3, 1, 2), (1, 1, 1)):
            torch.set_num_threads(n)
            producer, _ = _producer(tok, student, teacher, overlap=True)
            try:
                assert torch.get_num_threads() == upd
                assert producer.executor.submit(torch.get_num_threads).result() == gen
                assert producer.next(1.0, version=0).on_policy
            finally:
                producer.close()
            assert torch.get_num_threads() == n
    finally:
        torch.set_num_threads(before)


def test_lambda_zero_uses_no_student_samples_and_caches_teacher_samples(tok):
    student, teacher = tiny(tok, 3), tiny(tok, 4)
    s_gen, t_gen = CountingGenerate(student), CountingGenerate(teacher)
    producer, off = _producer(tok, student, teacher)
    batches = [producer.next(0.0, version=v) for v in range(12)]
    assert s_gen.calls == 0 and t_gen.calls >= 1
    assert not any(b.on_policy for b in batches) and all(b.version == -1 for b in batches)
    # 9 distinct prompts exist: each teacher sample is generated once, then served from the cache.
    assert sum(b.generated for b in batches) == len(off.cache["t"]) <= 9
    for b in batches:
        assert response_ids(b.rollout) == [off.cache["t"][p] for p in _prompts_of(tok, b)]


def _prompts_of(tok, batch):
    texts = []
    for seq_T, m_T in zip(batch.rollout.sequences_B_T, batch.rollout.attention_mask_B_T):
        ids = seq_T[: batch.rollout.prompt_width][m_T[: batch.rollout.prompt_width].bool()].tolist()
        texts.append("".join(tok.convert_ids_to_tokens(ids)))
    return texts


def test_lambda_one_uses_only_student_samples(tok):
    student, teacher = tiny(tok, 3), tiny(tok, 4)
    s_gen, t_gen = CountingGenerate(student), CountingGenerate(teacher)
    producer, off = _producer(tok, student, teacher)
    batches = [producer.next(1.0, version=v) for v in range(5)]
    assert s_gen.calls == 5 and t_gen.calls == 0 and off.cache["t"] == {}
    assert all(b.on_policy for b in batches) and [b.version for b in batches] == list(range(5))


def test_lambda_half_mixes_and_dataset_source_serves_gold_completions(tok):
    student, teacher = tiny(tok, 3), tiny(tok, 4)
    producer, _ = _producer(tok, student, teacher, lmbda_source="dataset", seed=3)
    batches = [producer.next(0.5, version=0) for _ in range(40)]
    n_on = sum(b.on_policy for b in batches)
    assert 10 <= n_on <= 30  # Binomial(40, 0.5): outside this range has probability < 0.2%
    gold = gold_map()
    for b in batches:
        if not b.on_policy:
            for prompt, ids in zip(_prompts_of(tok, b), response_ids(b.rollout)):
                assert ids == tok(gold[prompt], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            assert bool(b.rewards_B.all())  # gold completions pass the verifier


def test_gate_blocks_a_student_that_never_emits_eos(tok):
    torch.manual_seed(5)
    model = tiny(tok, 5)
    model.set_output_embeddings(FixedEOS(model.get_output_embeddings(), tok.eos_token_id, -1e9))
    prompts = {r: train_sets()[r][0] for r in ROUTES}
    res = compliance_gate(model, tok, prompts, {r: 6 for r in ROUTES}, threshold=0.5, well_formed=well_formed)
    assert not res.passed and sorted(res.failing) == sorted(ROUTES)
    assert all(v == 0.0 for v in res.eos_rate.values()) and all(v == 0.0 for v in res.format_rate.values())
    # EOS at once: every response ends, but an empty answer has no valid format, so the gate still blocks.
    model.set_output_embeddings(FixedEOS(model.get_output_embeddings().head, tok.eos_token_id, 1e9))
    res = compliance_gate(model, tok, prompts, {r: 6 for r in ROUTES}, threshold=0.5, well_formed=well_formed)
    assert all(v == 1.0 for v in res.eos_rate.values()) and not res.passed


def test_gate_passes_a_student_that_samples_well_formed_answers(tok, monkeypatch):
    """The gate itself, on a "student" whose samples are fixed: the gold completions, ended by EOS, pass; the same
    answers without the high budget's scratchpad fail that route alone. Only the sampling is replaced (the gate's
    counting and threshold run for real)."""
    import tasks.evaluation.evaluate

    gold = gold_map()

    def samples(strip_scratchpad: set[str]):
        def fake_generate(model, tok_, prompts, max_new_tokens, **kwargs):
            texts = [gold[p].split("|")[-1] if p in strip_scratchpad else gold[p] for p in prompts]
            return rollout_from_responses(tok_, prompts, [tok_(t, add_special_tokens=False)["input_ids"]
                                                          + [tok_.eos_token_id] for t in texts])
        return fake_generate

    prompts = {r: train_sets()[r][0] for r in ROUTES}
    caps = {r: 16 for r in ROUTES}
    monkeypatch.setattr(tasks.evaluation.evaluate, "generate", samples(set()))
    res = compliance_gate(tiny(tok, 5), tok, prompts, caps, threshold=0.5, well_formed=well_formed)
    assert res.passed and res.failing == [], res.describe()
    assert res.eos_rate == {r: 1.0 for r in ROUTES} and res.format_rate == {r: 1.0 for r in ROUTES}
    monkeypatch.setattr(tasks.evaluation.evaluate, "generate", samples(set(prompts["rev-high"])))
    res = compliance_gate(tiny(tok, 5), tok, prompts, caps, threshold=0.5, well_formed=well_formed)
    assert not res.passed and res.failing == ["rev-high"], res.describe()
    assert res.eos_rate["rev-high"] == 1.0 and res.format_rate["rev-high"] == 0.0
    assert not format_ok(Route.parse("rev-high"), "cba")  # the high budget needs its scratchpad
    assert not format_ok(Route.parse("sort-low"), "12|34")


def test_sequence_advantages_use_a_per_route_baseline():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    routes = ["a", "a", "b", "b", "c"]
    adv = sequence_advantages(rewards, routes, reward_weight=2.0)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0, 0.0])


def _batch_and_scores(tok, student, teacher, with_logprobs=False):
    torch.manual_seed(7)
    prompts, routes, answers = PromptSampler(train_sets(), 1).draw(9)
    batch = sample_batch(student, tok, prompts, routes, answers, [8] * 9, 0, with_logprobs=with_logprobs,
                         verifiers=VERIFIERS)
    groups = {"t": list(range(9))}
    return batch, score_with_teachers(checkpoint_teachers({"t": teacher}), groups, batch.rollout)


def test_route_weights_and_per_route_objectives(tok):
    student, teacher = tiny(tok, 8), tiny(tok, 9)
    batch, hidden = _batch_and_scores(tok, student, teacher)
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    objs = {"shift-low": Objective("reverse_kl"), "rev-high": Objective("forward_kl"), "sort-low": Objective("jsd")}
    st1 = update_step(student, batch, hidden, objs, opt)
    st2 = update_step(student, batch, hidden, objs, opt, route_weights={r: 2.0 for r in ROUTES})
    assert st2.loss == pytest.approx(2 * st1.loss, rel=1e-5)
    st0 = update_step(student, batch, hidden, objs, opt, route_weights={"rev-high": 0.0})
    expected = sum(st1.loss_sum[r] for r in ("shift-low", "sort-low")) / st1.tokens
    assert st0.loss == pytest.approx(expected, rel=1e-5)
    # Each route's summed objective is its own loss on its own rows.
    hs = forward_hidden(student, batch.rollout.sequences_B_T, batch.rollout.attention_mask_B_T)[:, :-1].detach()
    for r, obj in objs.items():
        idx = torch.tensor([i for i, x in enumerate(batch.routes) if x == r])
        assert len(idx) > 0, (r, batch.routes)  # every route's objective is checked, none skipped
        ref = chunked_objective(hs[idx], hidden["t"][1][idx, :-1], student.get_output_embeddings(),
                                teacher.get_output_embeddings(), batch.rollout.loss_mask_B_T()[idx], obj)
        assert st1.loss_sum[r] == pytest.approx(float(ref.loss_sum_B.sum()), rel=1e-4)


def test_sampled_token_objective_refuses_off_policy_batches(tok):
    student, teacher = tiny(tok, 8), tiny(tok, 9)
    batch, hidden = _batch_and_scores(tok, student, teacher, with_logprobs=False)
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    with pytest.raises(ValueError, match="behaviour log-probs"):
        update_step(student, batch, hidden, {r: Objective("sampled_token") for r in ROUTES}, opt)


def test_overlapped_generation_is_one_update_stale_and_syncs_weights(tok):
    student, teacher = tiny(tok, 10), tiny(tok, 11)
    producer, _ = _producer(tok, student, teacher, overlap=True)
    # The rollout model is a copy with storage of its own: the equality below holds only because each batch syncs.
    assert producer.rollout_model is not student, "the rollout model is the student itself: nothing to sync"
    assert not {p.data_ptr() for p in producer.rollout_model.parameters()} & {p.data_ptr() for p in student.parameters()}
    try:
        versions = []
        for v in range(4):
            batch = producer.next(1.0, version=v)
            versions.append(batch.version)
            for a, b in zip(producer.rollout_model.parameters(), student.parameters()):
                assert torch.equal(a, b)  # synced as the batch is taken
            with torch.no_grad():  # an "update": the student moves on
                for p in student.parameters():
                    p.add_(0.01)
        # The first batch is generated from the initial weights, then each batch lags the student by one update.
        assert versions == [0, 0, 1, 2]
    finally:
        producer.close()
    assert producer.pending is None


def test_overlapped_batches_come_from_the_producers_own_generator(tok):
    """With overlap the background thread samples from the producer's own generator: its batches are the same whatever
    the main thread does with torch's global RNG meanwhile (a reseed, dropout draws in the update), and a producer
    restored from a checkpoint's drained batch and generator state goes on with the batches of one never stopped."""
    student, teacher = tiny(tok, 10), tiny(tok, 11)

    def run(disturb: bool, producer=None, n: int = 4) -> list[torch.Tensor]:
        producer = producer or _producer(tok, student, teacher, overlap=True)[0]
        try:
            out = []
            for v in range(n):
                out.append(producer.next(1.0, version=v).rollout.sequences_B_T)
                if disturb:  # while the next batch is being generated
                    torch.manual_seed(1000 + v)
                    [torch.rand(256) for _ in range(2000)]
            return out
        finally:
            producer.close()

    reference = run(disturb=False)
    assert all(torch.equal(a, b) for a, b in zip(reference, run(disturb=True)))
    assert len({tuple(x.flatten().tolist()) for x in reference}) == 4  # the generator advances batch after batch
    # A checkpoint after two batches: the batch generated ahead, the sampler's and the generator's states.
    first, _ = _producer(tok, student, teacher, overlap=True)
    try:
        taken = [first.next(1.0, version=v).rollout.sequences_B_T for v in range(2)]
        pending, rng, sampler = first.drain(), first.rng_state(), first.sampler.rng.getstate()
    finally:
        first.close()
    resumed, _ = _producer(tok, student, teacher, overlap=True)
    resumed.prime(pending)
    resumed.set_rng_state(rng)
    resumed.sampler.rng.setstate(sampler)
    assert all(torch.equal(a, b) for a, b in zip(taken + run(disturb=True, producer=resumed, n=2), reference))


def test_teacher_pool_loads_lazily_evicts_least_recent_and_scores_the_same(tok):
    from tasks.modeling.teacher_pool import TeacherPool

    built = {f"t{i}": tiny(tok, 20 + i) for i in range(4)}
    loaded = []

    def load(name):
        loaded.append(name)
        return built[name]

    pool = TeacherPool(list(built), load, max_resident=2)
    assert pool.loads == 0 and len(pool) == 4 and "t3" in pool
    torch.manual_seed(3)
    prompts, routes, answers = PromptSampler(train_sets(), 2).draw(8)
    batch = sample_batch(tiny(tok, 30), tok, prompts, routes, answers, [6] * 8, 0, verifiers=VERIFIERS)
    groups = {"t0": [0, 1], "t1": [2, 3], "t2": [4, 5], "t3": [6, 7]}
    scored = score_with_teachers(checkpoint_teachers(pool), groups, batch.rollout)
    assert loaded == ["t0", "t1", "t2", "t3"] and pool.evictions == 2 and list(pool.resident) == ["t2", "t3"]
    reference = score_with_teachers(checkpoint_teachers(built), groups, batch.rollout)
    for name in groups:
        assert torch.equal(scored[name][1], reference[name][1])
    pool["t3"], pool["t2"]  # resident: no load, t2 becomes most recent
    assert pool.loads == 4
    pool["t0"]
    assert list(pool.resident) == ["t2", "t0"] and pool.loads == 5  # t3 was least recently used
    with pytest.raises(KeyError, match="no teacher 'nope'"):
        pool["nope"]
    unlimited = TeacherPool(list(built), load, max_resident=0)
    score_with_teachers(checkpoint_teachers(unlimited), groups, batch.rollout)
    assert len(unlimited.resident) == 4 and unlimited.evictions == 0


def test_repetition_rate_counts_repeated_trigrams():
    from tasks.training.distill import repetition_rate

    assert repetition_rate([1, 2, 3, 4, 5]) == 0.0
    assert repetition_rate([7, 7, 7, 7, 7, 7]) == pytest.approx(1 - 1 / 4)  # 4 trigrams, all (7, 7, 7)
    assert repetition_rate([1, 2, 3, 1, 2, 3]) == pytest.approx(1 - 3 / 4)  # (1,2,3) twice, (2,3,1), (3,1,2)
    assert repetition_rate([1, 2]) == 0.0


def test_pass_at_k_matches_the_combinatorial_definition():
    from math import comb

    from tasks.evaluation.evaluate import pass_at_k

    for n, c, k in [(10, 0, 1), (10, 3, 1), (10, 3, 4), (8, 8, 8), (5, 1, 5), (20, 7, 5)]:
        assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k))
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the sample accuracy
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_extrapolated_scores_target_the_teacher_at_scale_one_and_past_it_beyond(tok):
    """ExOPD on real models: with the reference's hidden states appended, the teacher head at scale 1 gives the
    teacher's log-probs, at scale 2 ``2 log p_T - log p_ref`` renormalised; the reference is scored once."""
    from tasks.training.distill import extrapolate_scores

    teacher, reference = tiny(tok, 1), tiny(tok, 2)
    prompts = [format_prompt(Route.parse("rev-high"), p) for p in PROBLEMS["rev-high"]]
    ro = rollout_from_responses(tok, prompts, [tok(gold_completion(Route.parse("rev-high"), p),
                                                   add_special_tokens=False)["input_ids"] for p in PROBLEMS["rev-high"]])
    scores = score_with_teachers(checkpoint_teachers({"t": teacher}), {"t": [0, 2]}, ro)
    with torch.no_grad():
        logp_t = torch.log_softmax(teacher(input_ids=ro.sequences_B_T[[0, 2]],
                                           attention_mask=ro.attention_mask_B_T[[0, 2]],
                                           position_ids=position_ids_from_mask(ro.attention_mask_B_T[[0, 2]])).logits, -1)
        logp_r = torch.log_softmax(reference(input_ids=ro.sequences_B_T[[0, 2]],
                                             attention_mask=ro.attention_mask_B_T[[0, 2]],
                                             position_ids=position_ids_from_mask(ro.attention_mask_B_T[[0, 2]])).logits, -1)
    mask = ro.attention_mask_B_T[[0, 2]].bool()
    costs = {}
    for scale, expected in ((1.0, logp_t), (2.0, torch.log_softmax(2 * logp_t - logp_r, -1))):
        rows, hidden, head, _, _ = extrapolate_scores(scores, reference, ro, scale, costs)["t"]
        assert rows == [0, 2] and hidden.shape[-1] == 64  # teacher width 32 + reference width 32
        with torch.no_grad():
            got = torch.log_softmax(head(hidden), -1)
        assert torch.allclose(got[mask], expected[mask], atol=1e-4)
    assert costs["reference"][0] == 2 * float(ro.attention_mask_B_T.sum())  # the whole batch, once per call


def test_route_normalization_scales_each_groups_tokens_to_the_batch_spread(tok):
    """opd.route_normalization: the step's loss is each group's summed reverse KL times std(batch) / std(group), the
    spreads computed here from the per-token KLs of the full logits (not the losses module's own sums)."""
    student, teacher = tiny(tok, 8), tiny(tok, 9)
    batch, hidden = _batch_and_scores(tok, student, teacher)
    opt = torch.optim.SGD(student.parameters(), lr=0.0)
    objs = {r: Objective("reverse_kl") for r in ROUTES}
    with torch.no_grad():
        hs = forward_hidden(student, batch.rollout.sequences_B_T, batch.rollout.attention_mask_B_T)[:, :-1]
        logq = torch.log_softmax(student.get_output_embeddings()(hs), -1)
        logp = torch.log_softmax(teacher.get_output_embeddings()(hidden["t"][1][:, :-1]), -1)
    kl_B_T = (logq.exp() * (logq - logp)).sum(-1)
    mask_B_T = batch.rollout.loss_mask_B_T().bool()
    pooled = kl_B_T[mask_B_T]
    for groups in ({r: r for r in ROUTES}, {"shift-low": "low", "sort-low": "low", "rev-high": "high"}):
        values = {g: kl_B_T[torch.tensor([groups[r] == g for r in batch.routes])][mask_B_T[torch.tensor(
            [groups[r] == g for r in batch.routes])]] for g in set(groups.values())}
        scale = {g: min(max(float(pooled.std(unbiased=False) / v.std(unbiased=False)), 0.25), 4.0)
                 for g, v in values.items()}
        expected = sum(scale[g] * float(v.sum()) for g, v in values.items()) / int(mask_B_T.sum())
        st = update_step(student, batch, hidden, objs, opt, normalize_groups=groups)
        assert st.loss == pytest.approx(expected, rel=1e-4), groups
        assert st.signal_scale == pytest.approx({r: scale[groups[r]] for r in ROUTES}, rel=1e-4)
        assert len(set(scale.values())) > 1  # the groups' spreads differ: a scale of 1 everywhere would fail here
    plain = update_step(student, batch, hidden, objs, opt)
    assert plain.loss == pytest.approx(float(pooled.sum()) / int(mask_B_T.sum()), rel=1e-4)
    assert plain.signal_scale == {}


def test_an_injected_error_derails_one_trace_token_and_leaves_a_bare_answer_alone(tok):
    import random

    from tasks.evaluation.evaluate import inject_error

    completion = "1x1,3x1,4x1|134"
    seen = set()
    for seed in range(40):
        prefix = inject_error(tok, completion, "134", random.Random(seed))
        # A strict prefix of the trace "1x1,3x1,4x1|" up to its last-but-one token, its last character wrong, and
        # that character one of the completion's own.
        assert 1 <= len(prefix) <= len("1x1,3x1,4x1")
        assert prefix[:-1] == completion[: len(prefix) - 1] and prefix[-1] != completion[len(prefix) - 1]
        assert prefix[-1] in set(completion)
        seen.add(len(prefix))
    assert len(seen) > 5  # the error lands at different steps
    assert inject_error(tok, "3|pju", "pju", random.Random(0))[0] in "|pju"  # the only step: the length
    assert inject_error(tok, "0235", "0235", random.Random(0)) is None  # a bare answer: no trace to derail
    assert inject_error(tok, "|0235", "0235", random.Random(0)) is None  # the separator alone
    assert inject_error(tok, "a>c|cdbc", "xyz", random.Random(0)) is None  # not ending in its answer


def test_recovery_continues_each_derailed_prefix_greedily_under_its_own_cap(tok):
    """recovery_rate's one batched generation equals generating each derailed prefix alone with the budget the
    route's cap leaves it, and the verifier sees the prefix and the continuation together."""
    import random

    from tasks.evaluation.evaluate import inject_error, recovery_rate
    from tasks.modeling.rollout import decode_responses, generate

    student = tiny(tok, 5)
    route = Route.parse("sort-high")
    problems = ["5203", "91", "777", "8812", "44019", "310"]
    prompts = [format_prompt(route, p) for p in problems]
    answers = [domain_of(route).answer(p) for p in problems]
    completions = [gold_completion(route, p) for p in problems]
    cap = 24
    seen: list[str] = []

    def verify(text, answer, row):  # passes a text whose continuation stayed within the cap's budget
        seen.append(text)
        return float(len(text) % 2 == 0)

    rate = recovery_rate(student, tok, verify, prompts, answers, completions, cap, seed=3)
    expected = []
    for i, (p, a, c) in enumerate(zip(prompts, answers, completions)):
        e = inject_error(tok, c, a, random.Random(3 * 1_000_003 + i))
        (cont,) = decode_responses(tok, generate(student, tok, [p + e], cap - len(e), greedy=True))
        expected.append(e + cont)
    assert seen == expected
    assert rate == sum(len(t) % 2 == 0 for t in expected) / len(expected)


def test_recovery_noise_rows_put_the_error_in_the_prompt_and_the_gold_rest_in_the_loss(tok):
    """DART-style rows (TrainConfig.recovery_noise): the wrong prefix is prompt (no loss), the gold rest after the
    replaced token is the completion; the prefix and the rest rebuild the gold completion but for that one token."""
    import random

    from tasks.evaluation.evaluate import derail
    from tasks.training.sft import noisy_row, sft_batch

    completion, answer, prompt = "0x1,2x1,3x1,5x1|0235", "0235", "<bos><sort><high>5203="
    for seed in range(30):
        prefix, rest = derail(tok, completion, answer, random.Random(seed))
        k = len(prefix) - 1  # the replaced character's place
        assert prefix[:k] + completion[k] + rest == completion and prefix[k] != completion[k]
    rng = random.Random(0)
    rows = [noisy_row(tok, prompt, completion, answer, 0.5, rng) for _ in range(200)]
    noisy = [r for r in rows if r != (prompt, completion)]
    assert 70 < len(noisy) < 130  # about half
    assert all(p.startswith(prompt) and len(p) > len(prompt) and completion.endswith(c) for p, c in noisy)
    batch = sft_batch(tok, [p for p, _ in noisy[:4]], [c for _, c in noisy[:4]])
    for i, (p, c) in enumerate(noisy[:4]):  # labelled: exactly the gold rest and EOS
        labelled = batch.labels_B_T[i][batch.labels_B_T[i] != -100].tolist()
        assert labelled == tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id]
    assert noisy_row(tok, "<bos><sort><low>5203=", "0235", "0235", 1.0, random.Random(0)) == (
        "<bos><sort><low>5203=", "0235")  # no trace: the row stays gold


def test_sampling_teacher_is_stable_per_prompt_and_shares_prompts_by_weight():
    from tasks.objectives.combine import sampling_teacher

    prompts = [f"prompt {i}" for i in range(4000)]
    picks = [sampling_teacher(p, ["a", "b"], [1, 3]) for p in prompts]
    assert picks == [sampling_teacher(p, ["a", "b"], [1, 3]) for p in prompts]  # the same teacher every time
    # Binomial(4000, 0.25): sd 27; outside 900-1100 has probability < 1e-4.
    assert 900 <= picks.count("a") <= 1100
    uniform = [sampling_teacher(p, ["a", "b", "c"]) for p in prompts]
    assert all(1200 <= uniform.count(n) <= 1470 for n in "abc")  # 1333 each, sd 30
    assert {sampling_teacher(p, ["only"]) for p in prompts[:50]} == {"only"}
    with pytest.raises(ValueError):
        sampling_teacher("x", ["a", "b"], [1, 0])


def test_off_policy_completions_of_a_route_with_two_teachers_come_from_both(tok):
    """A route with teachers [t, u]: each prompt's cached completion is its sampling_teacher's sample; the route
    without ``sample_from`` keeps its one teacher."""
    from tasks.objectives.combine import sampling_teacher

    t, u = tiny(tok, 4), tiny(tok, 6)
    teachers = checkpoint_teachers({"t": t, "u": u})
    two, one = ROUTES[0], ROUTES[1]
    off = OffPolicyData("teacher", tok, teachers, {r: "t" for r in ROUTES}, gold_map(), verifiers=VERIFIERS,
                        sample_from={two: (["t", "u"], []), one: (["t"], [])})
    sets = train_sets()
    prompts = sets[two][0] + sets[one][0]
    routes = [two] * len(sets[two][0]) + [one] * len(sets[one][0])
    off.batch(prompts, routes, [""] * len(prompts), [8] * len(prompts))
    want = {n: {p for p, r in zip(prompts, routes) if r == two and sampling_teacher(p, ["t", "u"]) == n}
            for n in ("t", "u")}
    assert want["t"] and want["u"], "the fixture's prompts should split between the two teachers"
    assert set(off.cache["u"]) == want["u"]
    assert set(off.cache["t"]) == want["t"] | set(sets[one][0])
