"""Guided OPD through the real merge flow on the quick model: route rev-high's specialist registered as a guided
teacher (``wrapper: guided``, the whole of its solution at first, withdrawn over 4 on-policy steps), the other
routes' plain. Watched at the update: rev-high's early rollouts start with its teacher's own sample (the prefix out
of the loss), later ones and the other routes' never do; MLflow holds the schedule and the prefix tokens per step."""

import pytest
from mlflow.tracking import MlflowClient

import tasks.merging.merge
import tasks.training.distill
from tasks.tracking.runs import tracking_uri

pytestmark = pytest.mark.e2e
GUIDE_STEPS = 4


@pytest.fixture(scope="module")
def guided(short_pipeline):
    from flows.merge import merge
    from teachers.registry import TeacherRegistry

    cfg, res = short_pipeline
    registry = TeacherRegistry()
    plain = {registry.get(n).route: registry.get(n) for n in res["teachers"]}
    record = registry.register_checkpoint("guided-rev-high", "rev-high", plain["rev-high"].model_uri,
                                          res["base_uri"], replace=True, wrapper="guided", guide_fraction=1.0,
                                          guide_steps=GUIDE_STEPS)
    names = [plain[r].name for r in plain if r != "rev-high"] + [record.name]
    mcfg = cfg.merge(res["base_uri"], names, label="guided")
    mcfg = mcfg.model_copy(update={"opd": mcfg.opd.model_validate({
        **mcfg.opd.model_dump(), "steps": 8, "eval_every": 8, "batch_size": 12, "gate_threshold": 0.0,
        "cold_start_steps": 0, "overlap_generation": False})})
    batches, samples = [], {}
    real_update = tasks.merging.merge.update_step
    real_samples = tasks.training.distill.OffPolicyData.teacher_samples

    def update_spy(student, batch, *args, **kwargs):
        batches.append(batch)
        return real_update(student, batch, *args, **kwargs)

    def samples_spy(self, texts, caps, generator=None):
        out = real_samples(self, texts, caps, generator)
        samples.update({t.prompt: ids for t, ids in zip(texts, out[0])})
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tasks.merging.merge, "update_step", update_spy)
        mp.setattr(tasks.training.distill.OffPolicyData, "teacher_samples", samples_spy)
        out = merge(mcfg)
    from tasks.modeling.rollout import eos_ids
    from tasks.specs.tokenizer import load_tokenizer

    return record, out, batches, samples, eos_ids(load_tokenizer(res["base_uri"]))


def test_guided_rollouts_start_from_the_teachers_own_solution_until_the_schedule_ends(guided):
    from tasks.training.guided import prefix_length

    record, out, batches, samples, eos = guided
    assert (record.wrapper, record.guide_fraction, record.guide_steps) == ("guided", 1.0, GUIDE_STEPS)
    assert len(batches) == 8 and all(b.on_policy for b in batches)
    seen = 0
    for step, batch in enumerate(batches):
        ro = batch.rollout
        for b, route in enumerate(batch.routes):
            spans = ro.spans(b)
            external = [s for s in spans if s.source == "external"]
            if route != "rev-high" or step >= GUIDE_STEPS:
                assert not external, (step, route, spans)
                continue
            sample = samples[batch.texts[b].prompt]
            start, end = ro.response_span(b)
            k = prefix_length(sample, 1 - step / GUIDE_STEPS, eos)  # that share of its tokens before its end
            assert ro.sequences_B_T[b, start:start + k].tolist() == sample[:k]
            assert external == ([(start, start + k, "external")] if k else [])
            assert not bool(ro.loss_mask_B_T()[b, start - 1:start - 1 + k].any())  # the prefix is out of the loss
            seen += k
        assert batch.guided_tokens == sum(e.end - e.start for b in range(len(batch.routes))
                                          for e in ro.spans(b) if e.source == "external")
    assert seen > 0


def test_mlflow_holds_the_schedule_and_the_merge_finishes(guided):
    _, out, _, _, _ = guided
    client = MlflowClient(tracking_uri())
    fractions = [m.value for m in sorted(client.get_metric_history(out["run_id"], "guide_fraction/rev-high"),
                                         key=lambda m: m.step)]
    assert fractions == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0, 0.0, 0.0]
    prefix = [m.value for m in sorted(client.get_metric_history(out["run_id"], "rollout/guided_tokens"),
                                      key=lambda m: m.step)]
    assert prefix[0] > 0 and prefix[GUIDE_STEPS:] == [0.0] * (8 - GUIDE_STEPS)
    rows = {r["route"]: r for r in out["rows"]}
    assert rows["rev-high"]["teacher"] == "guided-rev-high" and set(rows) == {"rev-low", "rev-high", "sort-low"}
